"""1. Reproducibility: the same request twice gives identical images; where batch-2 engines exist, a seed in a
batch of 2 gives the image it gives alone (in process: the served entry takes one image per request)."""

from __future__ import annotations

from ...families import family_info
from .base import Check, CheckContext, Outcome, max_abs_diff, workflow_fields, workflow_label


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.reproducibility
    outcome = Outcome(summary="")
    worst = 0
    for workflow in ctx.workflows:  # each declared workflow: img2img's encoder sample draws from the seed too
        for bucket in ctx.deployment.buckets:
            request = ctx.request(bucket.request, workflow, steps=settings.steps, seed=settings.seed,
                                  scheduler=_stochastic_scheduler(ctx), negative_prompt="blurry")
            first, second = ctx.generate(request), ctx.generate(request)
            diff = max_abs_diff(first, second)
            worst = max(worst, diff)
            outcome.rows.append({"bucket": bucket.label, "workflow": workflow.value, "max_abs_diff": diff,
                                 "identical": diff == 0})
            if diff:
                outcome.failures.append(f"bucket {bucket.label}{workflow_label(workflow)}: the same request twice "
                                        f"gave different images (max |diff| {diff} grey levels, seed {settings.seed})")
    outcome.figures["max_abs_diff_same_request"] = worst
    batch = _batch_of_two(ctx, settings)
    outcome.figures.update(batch)
    if batch.get("batch_independent") is False:
        outcome.failures.append(f"seed {settings.seed} in a batch of 2 differs from the same seed alone "
                                f"(max |diff| {batch['max_abs_diff_batch']} grey levels)")
    outcome.thresholds = {"max_abs_diff": 0}
    if batch.get("batch_na_reason"):
        outcome.notes.append(f"batch of 2: n/a: {batch['batch_na_reason']}")
    workflows = "" if len(ctx.workflows) == 1 else f" × {len(ctx.workflows)} workflows"
    outcome.summary = (f"same request twice: max |diff| {worst} (must be 0) over {len(ctx.deployment.buckets)} "
                       f"bucket(s){workflows}; batch of 2: " + ("n/a" if batch.get("batch_independent") is None else
                                                     "identical" if batch["batch_independent"] else "differs"))
    return outcome


def _stochastic_scheduler(ctx: CheckContext) -> str:
    """euler_a where the family has it: its noise at every step is drawn from the request's seed too, which is
    what must repeat. Flow-matching families (SD3, FLUX, Wan) have no ancestral sampler: their own."""
    from ...runtime.schedulers import scheduler_names

    return "euler_a" if "euler_a" in scheduler_names(ctx.resolved_model.family.value) else "default"


def _batch_of_two(ctx: CheckContext, settings) -> dict:
    """Image 0 of a batch of 2 against the same seed alone, in process over the same engines."""
    from ...runtime.loader import table_from_engines
    from ...runtime.pipeline import EnginePipeline, GenerationRequest

    model = ctx.resolved_model
    denoiser = family_info(model.family).denoiser.value
    batches = sorted({b for e in ctx.engines.found if e.spec.component == denoiser for b in e.spec.batches})
    cfg_batched = any(b % 2 == 0 for b in batches)
    needed = {4, 2} if cfg_batched else {2}
    if 2 not in model.batch:
        return {"batch_independent": None, "batch_na_reason": (
            f"no batch-2 engines: {ctx.model} is built for image batches {list(model.batch)} (its {denoiser} at "
            f"batch {', '.join(map(str, batches))}{', the CFG pair of one image' if cfg_batched else ''})")}
    if not needed & set(batches):
        return {"batch_independent": None, "batch_na_reason": f"no {denoiser} engine for a batch of 2 is built"}
    pipeline = EnginePipeline(model.source.path, model.family,
                              table_from_engines([e for e in ctx.engines.found if e.spec.lora_variant is None]),
                              model.workflows, text_lengths=model.text_lengths,  # Qwen-Image's engines.yaml range
                              step_cache=model.step_cache)  # the cached schedule, as the deployment runs it
    size = ctx.deployment.buckets[0].request
    from dataclasses import replace

    worst = 0
    for workflow in model.workflows:
        request = GenerationRequest(prompt="a red bicycle", height=size.height, width=size.width,
                                    steps=settings.steps, seed=settings.seed, frames=size.frames,
                                    **workflow_fields(workflow, size.height, size.width, settings.seed))
        alone = pipeline.generate(request).images[0]
        pair = pipeline.generate(replace(request, batch=2)).images[0]
        worst = max(worst, max_abs_diff(alone, pair))
    return {"batch_independent": worst <= 1, "max_abs_diff_batch": worst}


CHECK = Check("reproducibility", "Fixed-seed reproducibility", run)
