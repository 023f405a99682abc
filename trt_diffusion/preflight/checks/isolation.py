"""4. Scheduler isolation: concurrent requests with different schedulers, step counts and seeds give the images
they give one at a time (multistep schedulers keep state between steps: shared state shows here)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ...runtime.schedulers import scheduler_names
from .base import Check, CheckContext, Outcome, max_abs_diff, workflow_label


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.isolation
    schedulers = [name for name in scheduler_names(ctx.deployment.family) if name != "default"] or ["default"]
    # Neighbours share a scheduler name with different steps and seeds, and run at the same time: state kept
    # anywhere but in the request (a scheduler shared per name, a cached timestep table) shows as a mismatch.
    # ... and the declared workflows take turns, so every workflow runs beside the others (an img2img request's
    # trimmed schedule or begin index leaking into a neighbour shows too)
    workflows = ctx.workflows
    requests = [ctx.request(None, workflows[i % len(workflows)], scheduler=schedulers[(i // 2) % len(schedulers)],
                            steps=settings.steps[i % len(settings.steps)], seed=500 + i)
                for i in range(max(settings.requests, 2 * len(workflows)))]
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
                                 "workflow": request.workflow or "txt2img", "max_abs_diff": None, "error": str(b)})
            outcome.failures.append(f"{request.scheduler}, {request.steps} steps, seed {request.seed}"
                                    f"{_label(request)}: failed when run concurrently (alone it did not): "
                                    f"{type(b).__name__}: {b}")
            continue
        diff = max_abs_diff(a, b)
        outcome.rows.append({"scheduler": request.scheduler, "steps": request.steps, "seed": request.seed,
                             "workflow": request.workflow or "txt2img", "max_abs_diff": diff})
        if diff:
            outcome.failures.append(f"{request.scheduler}, {request.steps} steps, seed {request.seed}{_label(request)}"
                                    f": concurrent image differs from its one-at-a-time image (max |diff| {diff})")
    distinct = len({a.tobytes() for a in alone})
    if distinct < len(alone):
        outcome.notes.append(f"only {distinct} distinct images for {len(alone)} different requests")
    outcome.figures = {"requests": len(requests), "concurrency": settings.concurrency, "schedulers": ", ".join(
        dict.fromkeys(r.scheduler for r in requests)), "mismatches": len(outcome.failures)}
    outcome.summary = (f"{len(requests) - len(outcome.failures)}/{len(requests)} concurrent requests equal their "
                       f"one-at-a-time images ({len(set(r.scheduler for r in requests))} schedulers, "
                       f"{settings.concurrency} at once)")
    return outcome


def _label(request) -> str:
    from ...workflows import Workflow

    return workflow_label(Workflow(request.workflow or "txt2img"))


CHECK = Check("isolation", "Scheduler isolation", run)
