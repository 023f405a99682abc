"""4. Scheduler isolation: concurrent requests with different schedulers, step counts and seeds give the images
they give one at a time (multistep schedulers keep state between steps: shared state shows here)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ...runtime.schedulers import scheduler_names
from .base import Check, CheckContext, Outcome, max_abs_diff


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.isolation
    schedulers = [name for name in scheduler_names(ctx.deployment.family) if name != "default"] or ["default"]
    # Neighbours share a scheduler name with different steps and seeds, and run at the same time: state kept
    # anywhere but in the request (a scheduler shared per name, a cached timestep table) shows as a mismatch.
    requests = [ctx.request(scheduler=schedulers[(i // 2) % len(schedulers)],
                            steps=settings.steps[i % len(settings.steps)], seed=500 + i)
                for i in range(settings.requests)]
    alone = [ctx.generate(r) for r in requests]
    barrier = threading.Barrier(min(settings.concurrency, len(requests)))

    def together(index: int):
        if index < barrier.parties:
            barrier.wait(30)
        try:
            return ctx.generate(requests[index])
        except Exception as err:  # noqa: BLE001 - a request that fails only when not alone is this check's finding
            return err

    with ctx.deployment.taking_turns(), ThreadPoolExecutor(settings.concurrency) as pool:
        concurrent = list(pool.map(together, range(len(requests))))
    outcome = Outcome(summary="", thresholds={"max_abs_diff": 0})
    for request, a, b in zip(requests, alone, concurrent):
        if isinstance(b, Exception):
            outcome.rows.append({"scheduler": request.scheduler, "steps": request.steps, "seed": request.seed,
                                 "max_abs_diff": None, "error": str(b)})
            outcome.failures.append(f"{request.scheduler}, {request.steps} steps, seed {request.seed}: failed when "
                                    f"run concurrently (alone it did not): {type(b).__name__}: {b}")
            continue
        diff = max_abs_diff(a, b)
        outcome.rows.append({"scheduler": request.scheduler, "steps": request.steps, "seed": request.seed,
                             "max_abs_diff": diff})
        if diff:
            outcome.failures.append(f"{request.scheduler}, {request.steps} steps, seed {request.seed}: concurrent "
                                    f"image differs from its one-at-a-time image (max |diff| {diff})")
    distinct = len({a.tobytes() for a in alone})
    if distinct < len(alone):
        outcome.notes.append(f"only {distinct} distinct images for {len(alone)} different requests")
    outcome.figures = {"requests": len(requests), "concurrency": settings.concurrency, "schedulers": ", ".join(
        dict.fromkeys(r.scheduler for r in requests)), "mismatches": len(outcome.failures)}
    outcome.summary = (f"{len(requests) - len(outcome.failures)}/{len(requests)} concurrent requests equal their "
                       f"one-at-a-time images ({len(set(r.scheduler for r in requests))} schedulers, "
                       f"{settings.concurrency} at once)")
    return outcome


CHECK = Check("isolation", "Scheduler isolation", run)
