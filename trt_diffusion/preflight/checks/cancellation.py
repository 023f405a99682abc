"""5. Cancellation frees resources: every instance busy with a long request whose client deadline passes
mid-generation; the loop must stop early (counted in denoiser calls, not timed), the instances serve the next
request, and memory comes back within a bound. HTTP cannot cancel a request: n/a there."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ...errors import ServeError
from ...triton.client import RequestCancelled
from .base import Check, CheckContext, Outcome, not_applicable

MB = 1024 ** 2
SETTLE_S = 0.25  # the count is settled when it holds still this long, three times over


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.cancellation
    deployment = ctx.deployment
    reason = deployment.cancel_unavailable_reason()
    if reason:
        return not_applicable(reason)
    if deployment.denoiser_calls() is None:
        return not_applicable("the deployment does not report its denoiser calls (Triton statistics unavailable)")
    per_step = _calls_per_step(ctx)
    before = deployment.memory()
    start_count = deployment.denoiser_calls()
    parallel = deployment.instances or 1
    long_request = ctx.request(steps=settings.steps, seed=7)

    def cancelled(_):
        try:
            deployment.generate(long_request, settings.deadline_s)
        except RequestCancelled:
            return "cancelled"
        except ServeError as err:
            return f"error: {err}"
        return "finished"

    with ThreadPoolExecutor(parallel) as pool:
        results = list(pool.map(cancelled, range(parallel)))
    ran = _settled(deployment, start_count, parallel * settings.steps * per_step, ctx) - start_count
    full = parallel * settings.steps * per_step
    outcome = Outcome(summary="", thresholds={"max_denoiser_calls": f"< {full} (the loops' full length)",
                                              "max_memory_growth_mb": settings.max_memory_growth_mb})
    next_ok, next_s = _next_request(ctx)
    after = deployment.memory()
    growth = None
    if before is not None and after is not None and before.cpu_bytes is not None and after.cpu_bytes is not None:
        growth = (after.cpu_bytes - before.cpu_bytes) / MB
    outcome.figures = {"requests": parallel, "steps": settings.steps, "deadline_s": settings.deadline_s,
                       "denoiser_calls_per_step": per_step, "denoiser_calls_after_deadline": ran,
                       "denoiser_calls_if_not_cancelled": full, "next_request_served": next_ok,
                       "next_request_s": next_s, "memory_growth_mb": growth,
                       "memory_source": None if after is None else after.source}
    if any(r == "finished" for r in results):
        outcome.failures.append(f"a {settings.steps}-step request finished within its {settings.deadline_s:g} s "
                                "deadline: nothing was cancelled (raise cancellation.steps)")
    for r in results:
        if r.startswith("error"):
            outcome.failures.append(f"the deadline surfaced as an error, not a cancellation: {r}")
    if ran >= full:
        outcome.failures.append(f"the loop ignored cancellation: {ran} of {full} denoiser calls ran for "
                                f"{parallel} request(s) cancelled after {settings.deadline_s:g} s")
    if not next_ok:
        outcome.failures.append(f"after the cancellation the next request was not served: {next_s}")
    if growth is not None and growth > settings.max_memory_growth_mb:
        outcome.failures.append(f"memory grew {growth:.0f} MB over the cancellation (bound "
                                f"{settings.max_memory_growth_mb:g} MB)")
    if growth is None:
        outcome.notes.append("memory: " + deployment.memory_unavailable_reason())
    outcome.summary = (f"{parallel} request(s) cancelled at {settings.deadline_s:g} s: {ran} of {full} denoiser "
                       f"calls ran; next request {'served' if next_ok else 'NOT served'}; memory "
                       + ("n/a" if growth is None else f"{growth:+.0f} MB (bound {settings.max_memory_growth_mb:g})"))
    return outcome


def _calls_per_step(ctx: CheckContext) -> int:
    """Denoiser calls of one step (1 with batched CFG, 2 split), counted on a 2-step request."""
    before = ctx.deployment.denoiser_calls()
    ctx.generate(ctx.request(steps=2, seed=3))
    counted = _settled(ctx.deployment, before, None, ctx) - before
    return max(1, round(counted / 2))


def _settled(deployment, start: int, full: int | None, ctx: CheckContext) -> int:
    """The denoiser call count once it stops moving (or reaches `full`)."""
    last, still = deployment.denoiser_calls(), 0
    while still < 3 and time.monotonic() < ctx.deadline - 1:
        if full is not None and last - start >= full:
            break
        time.sleep(SETTLE_S)
        now = deployment.denoiser_calls()
        still = still + 1 if now == last else 0
        last = now
    return last


def _next_request(ctx: CheckContext) -> tuple[bool, float | str]:
    start = time.perf_counter()
    try:
        ctx.generate(ctx.request(steps=2, seed=9), timeout_s=60)
    except Exception as err:  # noqa: BLE001 - the finding
        return False, str(err)
    return True, time.perf_counter() - start


CHECK = Check("cancellation", "Cancellation frees resources", run)
