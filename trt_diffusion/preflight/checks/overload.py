"""8. Overload: capacity measured closed-loop, then open-loop arrivals at load_factor x capacity for a bounded
time: P50/P99 of the accepted requests, refusal rate and refusal latency, no errors, nothing hung, the server
healthy after. Where the model declares `serving: overload:`, what that policy does at the same offered load: the API's
own OverloadGate simulated in virtual time over the measured service time (openai_api/overload_simulation.py), not
a second load run: Triton alone has no such policy, the API in front of it applies it."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from ...engines_file.schema import OverloadSettings
from ...openai_api.overload import OverloadPolicy, describe
from ...openai_api.overload_simulation import simulate
from ...triton.client import RequestRejected
from .base import Check, CheckContext, Outcome, not_applicable, percentile, seconds_text

MAX_WORKERS = 128


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.overload
    deployment = ctx.deployment
    if deployment.kind != "served":
        return not_applicable("in process there is no server and no queue to overload")
    instances = deployment.instances or 1
    capacity, service_s, levels = _capacity(ctx, instances)
    rate = settings.load_factor * capacity
    outcome = _open_loop(ctx, rate, settings)
    figures = outcome.figures
    queue = deployment.max_queue_size
    excess = (settings.load_factor - 1) * capacity
    fill_s = queue / excess if queue and excess > 0 else None
    figures.update({"capacity_rps": capacity, "service_p50_s": service_s, "offered_rps": rate,
                    "load_factor": settings.load_factor, "duration_s": settings.duration_s,
                    "max_queue_size": queue, "instances": instances, "queue_fill_s": fill_s})
    outcome.rows = levels
    outcome.thresholds = {"errors": 0, "hung": 0, "max_refusal_p99_s": settings.max_refusal_s,
                          "max_accepted_p99_s": settings.max_accepted_p99_s,
                          "max_latency_growth": settings.max_latency_growth}
    if figures["errors"]:
        outcome.failures.append(f"{figures['errors']} request(s) failed with an error, not a refusal: "
                                f"{figures.pop('first_error')}")
    figures.pop("first_error", None)
    if figures["hung"]:
        outcome.failures.append(f"{figures['hung']} request(s) had no answer within "
                                f"{settings.request_timeout_s:g} s: hung")
    p99 = figures["accepted_p99_s"]
    growth = figures["latency_growth"]
    # Waits that grow while nothing is refused: the queue takes every request, so under overload they grow for as
    # long as it lasts. (Waits that drift while the queue sheds load are the machine's noise, not a missing bound.)
    if growth is not None and growth > settings.max_latency_growth and not figures["refused"]:
        why = "the entry declares no max_queue_size" if not queue else (
            f"its queue of {queue} takes {fill_s:.1f} s to fill at this load: raise overload.duration_s well past "
            "that, or bound the queue lower" if fill_s and fill_s > settings.duration_s / 4 else
            f"a queue of {queue} does not bound them")
        outcome.failures.append(f"accepted requests waited longer and longer: median {seconds_text(figures['wait_q4_s'])} "
                                f"for the last quarter's arrivals vs {seconds_text(figures['wait_q2_s'])} for the "
                                f"second's (x{growth:.2f} > x{settings.max_latency_growth:g}): under overload waits "
                                f"grow without bound and nothing was refused ({why}); the excess must be "
                                "refused")
    if settings.max_accepted_p99_s and p99 is not None and p99 > settings.max_accepted_p99_s:
        outcome.failures.append(f"accepted P99 {p99:.2f} s > max_accepted_p99_s {settings.max_accepted_p99_s:g} s")
    refusal_p99 = figures["refusal_p99_s"]
    if refusal_p99 is not None and refusal_p99 > settings.max_refusal_s:
        outcome.failures.append(f"refusal P99 {refusal_p99:.2f} s > {settings.max_refusal_s:g} s: refused late, "
                                "not at once")
    if not figures["refused"]:
        outcome.notes.append("nothing was refused: the server kept up with the offered load (capacity measured "
                             "low on a busy machine) or its queue absorbed the excess for the whole run")
    health = deployment.health()
    figures["healthy_after"] = health is None
    if health is None:
        try:
            ctx.generate(ctx.request(steps=2, seed=99), timeout_s=60)
        except Exception as err:  # noqa: BLE001 - the finding
            health = f"a request after the overload failed: {err}"
            figures["healthy_after"] = False
    if health is not None:
        outcome.failures.append(f"server not healthy after the overload: {health}")
    outcome.summary = (f"capacity {capacity:.1f} req/s; at {rate:.1f} req/s for {settings.duration_s:g} s: "
                       f"{figures['accepted']} accepted (P50 {seconds_text(figures['accepted_p50_s'])}, P99 "
                       f"{seconds_text(p99)}, wait growth x{growth or 0:.2f}), {figures['refused']} refused "
                       f"({figures['refusal_rate']:.0%}, P99 {seconds_text(refusal_p99)}), {figures['errors']} errors, "
                       f"{figures['hung']} hung")
    bucket = deployment.buckets[0].request  # what ctx.request asks for
    policy_figures, policy_notes, policy_summary = policy_effect(
        ctx.resolved_model.serving.overload, size=str(bucket), steps=settings.steps, service_s=service_s, rate=rate,
        duration_s=settings.duration_s, instances=instances,
        served_sizes=tuple(str(b.request) for b in deployment.buckets),
        resizable=not ctx.natural_workflow.needs_image, video=bucket.is_video)
    figures.update(policy_figures)
    outcome.notes.extend(policy_notes)
    outcome.summary += policy_summary
    return outcome


def policy_effect(overload: OverloadSettings | None, *, size: str, steps: int, service_s: float, rate: float,
                  duration_s: float, instances: int, served_sizes: tuple[str, ...] = (), resizable: bool = True,
                  video: bool = False) -> tuple[dict, list[str], str]:
    """What the model's `serving: overload:` policy does at `rate` for `duration_s`, simulated over the measured
    `service_s` of a `steps`-step request (figures `policy_*`, notes, a summary tail); a note alone without one."""
    if overload is None:
        return {}, ["the model declares no `serving: overload:` policy: the OpenAI API in front of Triton neither "
                    "degrades nor refuses its requests for load (Triton's full queue still answers 429)"], ""
    if video:
        return {}, ["the `serving: overload:` policy acts on online image requests: a video model's clips are jobs, "
                    "never degraded or refused by it (not simulated)"], ""
    policy = OverloadPolicy.from_settings(overload)
    result = simulate(policy, service_s / steps, size=size, steps=steps, rate=rate, duration_s=duration_s,
                      instances=instances, served_sizes=served_sizes, resizable=resizable)
    degraded = sum(result.degraded.values())
    retry = result.retry_after_s
    figures = {"policy": describe(policy), "policy_service_s": service_s,
               "policy_capacity_rps": instances / service_s if service_s > 0 else None,
               "policy_offered": result.offered, "policy_as_asked": result.as_asked, "policy_degraded": degraded,
               "policy_degraded_to": ", ".join(sorted(result.degraded)) or None, "policy_refused": result.refused,
               "policy_wait_p50_s": percentile(result.waits_s, 50), "policy_wait_p99_s": percentile(result.waits_s, 99),
               "policy_retry_after_min_s": min(retry) if retry else None,
               "policy_retry_after_max_s": max(retry) if retry else None,
               "policy_max_estimated_wait_s": result.max_estimated_wait_s}
    notes = []
    reached = result.max_estimated_wait_s
    if overload.degrade_after_s is not None and not degraded:
        if reached < overload.degrade_after_s:
            notes.append(f"the policy never degrades at this load: the estimated wait reached at most "
                         f"{reached:.2f} s, below degrade_after_s {overload.degrade_after_s:g} s")
        else:
            lowered = (f"degrade: steps {overload.degrade.steps} is not below the check's {steps} steps"
                       if overload.degrade.steps is not None else
                       f"degrade: size {overload.degrade.size} is not a smaller size served ({', '.join(served_sizes)})"
                       if resizable else "an image workflow's request is never resized")
            notes.append(f"the estimated wait passed degrade_after_s {overload.degrade_after_s:g} s but nothing was "
                         f"lowered: {lowered}")
    if overload.refuse_after_s is not None and not result.refused:
        notes.append(f"the policy never refuses at this load: the estimated wait reached at most {reached:.2f} s, "
                     f"below refuse_after_s {overload.refuse_after_s:g} s")
    tail = (f"; the API's overload policy (simulated over the measured service time): {result.as_asked} as asked, "
            f"{degraded} degraded" + (f" ({figures['policy_degraded_to']})" if degraded else "")
            + f", {result.refused} refused"
            + (f" (Retry-After {min(retry)}-{max(retry)} s)" if retry else "")
            + f", wait P50 {seconds_text(figures['policy_wait_p50_s'])} P99 {seconds_text(figures['policy_wait_p99_s'])}")
    return figures, notes, tail


def _capacity(ctx: CheckContext, instances: int) -> tuple[float, float, list[dict]]:
    """Closed loop at `instances` and 2 x `instances` clients: the best throughput, and the median latency
    with every instance busy (the service time)."""
    settings = ctx.settings.overload
    levels, best, service = [], 0.0, None
    for concurrency in dict.fromkeys((instances, 2 * instances)):
        latencies, stop = [], time.monotonic() + settings.capacity_s
        lock = threading.Lock()

        def client(index: int) -> None:
            seed = 1000 * index
            while time.monotonic() < stop:
                start = time.perf_counter()
                try:
                    ctx.generate(ctx.request(steps=settings.steps, seed=seed), timeout_s=settings.request_timeout_s)
                except RequestRejected:
                    continue
                with lock:
                    latencies.append(time.perf_counter() - start)
                seed += 1

        began = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(client, range(concurrency)))
        elapsed = time.perf_counter() - began
        throughput = len(latencies) / elapsed if elapsed > 0 else 0.0
        median = statistics.median(latencies) if latencies else None
        levels.append({"phase": "capacity", "concurrency": concurrency, "completed": len(latencies),
                       "throughput_rps": throughput, "p50_s": median})
        if service is None:
            service = median
        best = max(best, throughput)
    if not best or service is None:
        raise RuntimeError("no request completed while measuring capacity")
    return best, service, levels


def _open_loop(ctx: CheckContext, rate: float, settings) -> Outcome:
    """Arrivals every 1/rate s for duration_s, each timed from its scheduled arrival (no coordinated omission)."""
    interval = 1.0 / rate
    count = max(1, int(settings.duration_s * rate))
    results: list[tuple[str, float, str, int]] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def one(index: int) -> None:
        scheduled = start + index * interval
        try:
            ctx.deployment.generate(ctx.request(steps=settings.steps, seed=index), settings.request_timeout_s)
            kind, message = "accepted", ""
        except RequestRejected as err:
            kind, message = "refused", str(err)
        except Exception as err:  # noqa: BLE001 - counted as an error
            kind, message = "error", str(err)
        with lock:
            results.append((kind, time.perf_counter() - scheduled, message, index))

    workers = min(MAX_WORKERS, max(8, int(rate * settings.request_timeout_s) + 1))
    pool = ThreadPoolExecutor(workers)
    futures = []
    try:
        for index in range(count):
            delay = start + index * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, index))
        done, not_done = wait(futures, timeout=settings.request_timeout_s + 5)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    accepted = [s for kind, s, _, _ in results if kind == "accepted"]
    refused = [s for kind, s, _, _ in results if kind == "refused"]
    errors = [m for kind, _, m, _ in results if kind == "error"]

    def quarter(q: int) -> float | None:  # median latency of the accepted requests that arrived in quarter q
        chosen = [s for kind, s, _, i in results if kind == "accepted" and (q - 1) * count <= 4 * i < q * count]
        return percentile(chosen, 50)

    q2, q4 = quarter(2), quarter(4)
    figures = {"sent": count, "accepted": len(accepted), "refused": len(refused), "errors": len(errors),
               "hung": len(not_done), "refusal_rate": len(refused) / count,
               "accepted_p50_s": percentile(accepted, 50), "accepted_p99_s": percentile(accepted, 99),
               "refusal_p50_s": percentile(refused, 50), "refusal_p99_s": percentile(refused, 99),
               "wait_q2_s": q2, "wait_q4_s": q4, "latency_growth": q4 / q2 if q2 and q4 else None,
               "first_error": errors[0] if errors else None}
    return Outcome(summary="", figures=figures)


CHECK = Check("overload", "Overload behaviour", run)
