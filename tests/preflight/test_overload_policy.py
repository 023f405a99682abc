"""The overload check's report of the model's `serving: overload:` policy (checks/overload.policy_effect, the part of
the check after its load run, fed what that run measured): the policy's figures when engines.yaml declares one, a
note when it does not, a note (never a failure) for a policy that cannot act at the check's load. The load run
itself needs a server (test_served.py)."""

from __future__ import annotations

import pytest

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.preflight.checks.overload import policy_effect

ENGINES = """version: 1
models:
  sd15:
    source: ./not-needed
    family: sd15
    buckets: [64x64, 32x32]
{serving}"""


def overload_of(tmp_path, block: str | None):
    """The model's `serving: overload:` as the check reads it (ctx.resolved_model.serving.overload)."""
    serving = f"    serving:\n      overload: {block}\n" if block else ""
    path = tmp_path / "engines.yaml"
    path.write_text(ENGINES.format(serving=serving))
    return load_engines_file(path, check_sources=False).models["sd15"].serving.overload


# as the check measured on the tiny model: 10-step requests of 0.5 s, one instance, 1.5 x its 2 req/s for 10 s
MEASURED = dict(size="64x64", steps=10, service_s=0.5, rate=3.0, duration_s=10.0, instances=1,
                served_sizes=("64x64", "32x32"))


def test_a_declared_policy_is_reported_with_its_effect(tmp_path):
    overload = overload_of(tmp_path, "{degrade_after_s: 1, refuse_after_s: 2, degrade: {steps: 4}}")
    figures, notes, summary = policy_effect(overload, **MEASURED)
    assert figures["policy"] == "degraded to 4 steps past 1 s of estimated wait, refused past 2 s"
    assert figures["policy_offered"] == 30 and figures["policy_capacity_rps"] == 2.0
    assert figures["policy_degraded"] > 0 and figures["policy_degraded_to"] == "steps 10->4"
    assert figures["policy_offered"] == (figures["policy_as_asked"] + figures["policy_degraded"]
                                         + figures["policy_refused"])
    assert figures["policy_wait_p99_s"] <= 2.0 and figures["policy_wait_p50_s"] <= figures["policy_wait_p99_s"]
    if figures["policy_refused"]:
        assert 1 <= figures["policy_retry_after_min_s"] <= figures["policy_retry_after_max_s"]
    assert notes == [] or all("never refuses" in note for note in notes)
    assert "the API's overload policy (simulated over the measured service time)" in summary
    assert f"{figures['policy_degraded']} degraded (steps 10->4)" in summary
    assert policy_effect(overload, **MEASURED) == (figures, notes, summary)  # deterministic


def test_refusals_carry_their_retry_after_range(tmp_path):
    overload = overload_of(tmp_path, "{refuse_after_s: 1}")
    figures, notes, summary = policy_effect(overload, **MEASURED)
    assert figures["policy_refused"] > 0 and figures["policy_degraded"] == 0 and figures["policy_degraded_to"] is None
    assert figures["policy_retry_after_min_s"] == figures["policy_retry_after_max_s"] == 1
    assert notes == [] and "refused (Retry-After 1-1 s)" in summary


def test_no_policy_is_a_note_and_no_figures(tmp_path):
    figures, notes, summary = policy_effect(overload_of(tmp_path, None), **MEASURED)
    assert figures == {} and summary == ""
    assert len(notes) == 1 and "declares no `serving: overload:` policy" in notes[0]


@pytest.mark.parametrize("block, said", [
    ("{degrade_after_s: 30, refuse_after_s: 60, degrade: {steps: 4}}",
     ["never degrades at this load: the estimated wait reached at most", "never refuses at this load"]),
    ("{degrade_after_s: 1, degrade: {steps: 20}}", ["degrade: steps 20 is not below the check's 10 steps"]),
    ("{degrade_after_s: 1, degrade: {size: 32x32}}", []),  # acts: a smaller served bucket
])
def test_a_policy_that_cannot_act_at_this_load_is_a_note(tmp_path, block, said):
    figures, notes, _ = policy_effect(overload_of(tmp_path, block), **MEASURED)
    assert len(notes) == len(said) and all(text in note for text, note in zip(said, notes)), notes
    assert figures["policy_offered"] == 30


def test_a_video_model_is_not_simulated(tmp_path):
    overload = overload_of(tmp_path, "{refuse_after_s: 1}")
    figures, notes, _ = policy_effect(overload, **{**MEASURED, "size": "64x64x9"}, video=True)
    assert figures == {} and "clips are jobs" in notes[0]
