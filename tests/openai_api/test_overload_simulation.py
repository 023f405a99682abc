"""The overload policy simulated in virtual time (openai_api/overload_simulation.py: the real OverloadGate, a fixed
cost model, arrivals every 1/rate s, FIFO servers): below degrade_after_s nothing is lowered, between the thresholds
requests run degraded, past refuse_after_s they are refused with Retry-After; the counts add up and two runs are
the same. Times are binary fractions (1/8 s a step) so the hand-worked sequences below compare exactly."""

from __future__ import annotations

import pytest

from trt_diffusion.openai_api.overload import OverloadPolicy
from trt_diffusion.openai_api.overload_simulation import simulate

PER_STEP_S = 0.125  # 8 steps: 1 s a request, 4 steps: 0.5 s
STEPS = 8


def run(policy: OverloadPolicy, rate: float, duration_s: float = 10.0, **options):
    return simulate(policy, PER_STEP_S, size="64x64", steps=STEPS, rate=rate, duration_s=duration_s, **options)


def assert_adds_up(result) -> None:
    assert result.offered == result.as_asked + sum(result.degraded.values()) + result.refused
    assert len(result.waits_s) == len(result.latencies_s) == result.accepted
    assert len(result.retry_after_s) == result.refused


def test_below_degrade_after_nothing_is_lowered():
    policy = OverloadPolicy(degrade_after_s=0.5, refuse_after_s=5, degrade_steps=4)
    # one request every 2 s, each 1 s long: nothing is ever ahead of an arrival
    idle = run(policy, rate=0.5, duration_s=20)
    assert (idle.offered, idle.as_asked, idle.refused, dict(idle.degraded)) == (10, 10, 0, {})
    assert idle.waits_s == [0.0] * 10 and idle.latencies_s == [1.0] * 10 and idle.max_estimated_wait_s == 0.0
    # 1.5x one server's capacity, but spread over two instances the estimated wait stays at 0.5 s
    shared = run(OverloadPolicy(degrade_after_s=1.0, degrade_steps=4), rate=1.5, instances=2)
    assert shared.as_asked == shared.offered == 15 and shared.max_estimated_wait_s == 0.5
    assert_adds_up(shared)


def test_between_the_thresholds_requests_run_degraded():
    policy = OverloadPolicy(degrade_after_s=1.0, refuse_after_s=3.0, degrade_steps=4)
    result = run(policy, rate=2.0, duration_s=5.0)  # twice one server's capacity
    # t=0 runs 0-1 as asked; t=0.5 finds 1 s ahead: 4 steps, 1-1.5; t=1 finds 0.5 s: as asked, 1.5-2.5;
    # from t=1.5 every arrival finds 1 s or more ahead and runs 0.5 s: exactly the arrival rate, never refused
    assert (result.offered, result.as_asked, result.refused) == (10, 2, 0)
    assert dict(result.degraded) == {"steps 8->4": 8}
    assert result.waits_s == [0.0, 0.5, 0.5] + [1.0] * 7
    assert result.latencies_s[:3] == [1.0, 1.0, 1.5] and result.max_estimated_wait_s == 1.5
    assert_adds_up(result)


def test_past_refuse_after_requests_are_refused_with_retry_after():
    policy = OverloadPolicy(degrade_after_s=1.0, refuse_after_s=2.0, degrade_steps=4)
    result = run(policy, rate=4.0, duration_s=5.0)  # four times one server's capacity
    assert result.offered == 20 and result.refused > 0 and result.degraded["steps 8->4"] > 0
    assert result.retry_after_s and all(seconds >= 1 for seconds in result.retry_after_s)
    # the estimated wait an arrival may start behind is bounded by the refusal: at most 2 s of work, less a bit
    assert max(result.waits_s) <= 2.0
    assert_adds_up(result)
    # a refusal's Retry-After is the seconds until the estimated wait is back under refuse_after_s
    slow = run(OverloadPolicy(refuse_after_s=2.0), rate=8.0, duration_s=2.0)
    assert slow.refused and max(slow.retry_after_s) == 1 and slow.max_estimated_wait_s == 2.0


def test_a_size_degradation_runs_the_smaller_bucket():
    policy = OverloadPolicy(degrade_after_s=1.0, degrade_size="32x32")
    result = run(policy, rate=2.0, duration_s=5.0, served_sizes=("64x64", "32x32"))
    assert set(result.degraded) == {"size 64x64->32x32"}
    assert min(latency - wait for latency, wait in zip(result.latencies_s, result.waits_s)) == 0.25  # a quarter
    edits = run(policy, rate=2.0, duration_s=5.0, served_sizes=("64x64", "32x32"), resizable=False)
    assert not edits.degraded and edits.as_asked == edits.offered


def test_the_simulation_is_deterministic():
    policy = OverloadPolicy(degrade_after_s=1.0, refuse_after_s=2.5, degrade_steps=15)
    first = simulate(policy, 0.0173, size="64x64", steps=30, rate=20.3, duration_s=60, instances=3)
    again = simulate(policy, 0.0173, size="64x64", steps=30, rate=20.3, duration_s=60, instances=3)
    assert first == again and first.refused and first.degraded
    assert_adds_up(first)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="rate must be positive"):
        run(OverloadPolicy(refuse_after_s=1), rate=0)
