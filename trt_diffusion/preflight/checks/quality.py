"""7. Quality regression: a fixed prompt x seed set, for every declared workflow, against the stored baseline
(same engine keys), PSNR and SSIM per image (LPIPS when its weights are present), gated. `--save-baseline` stores
this run's images instead. The report shows each image beside its baseline (and the workflow's input and mask)."""

from __future__ import annotations

from ...metrics import Thresholds
from ...parity.report.judge import compare_image
from ...workflows import Workflow
from ..baseline import Baseline, folder_for
from .base import Check, CheckContext, Outcome, not_applicable, workflow_fields


def quality_size(ctx: CheckContext):
    return ctx.deployment.buckets[0].request


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.quality
    size = quality_size(ctx)
    images = {}
    for workflow in ctx.workflows:
        for prompt in settings.prompts:
            for seed in settings.seeds:
                images[(workflow.value, prompt, seed)] = ctx.generate(ctx.request(
                    size, workflow, prompt=prompt, seed=seed, steps=settings.steps,
                    guidance_scale=settings.guidance_scale))
    if ctx.save_baseline:
        ctx.saved["baseline"] = Baseline(folder_for(ctx.config, ctx.model, ctx.settings), ctx.model, ctx.target,
                                         list(ctx.deployment.engine_keys), str(size), settings.steps,
                                         settings.guidance_scale, images)
        outcome = not_applicable(f"baseline saved ({len(images)} images at {size}, {settings.steps} steps) to "
                                 f"{ctx.saved['baseline'].folder}: the next run compares against it",
                                 images=len(images))
        return outcome
    thresholds = Thresholds(min_psnr_db=settings.min_psnr_db, min_ssim=settings.min_ssim,
                            max_lpips=settings.max_lpips)
    outcome = Outcome(summary="", thresholds=thresholds.model_dump())
    worst_psnr, worst_ssim = float("inf"), 1.0
    shown = ctx.saved.setdefault("report_images", {})  # PNGs the report shows, written beside it
    for index, ((workflow, prompt, seed), image) in enumerate(images.items()):
        baseline = ctx.baseline.images[(workflow, prompt, seed)]
        compared = compare_image(prompt=prompt, seed=seed, reference=baseline, candidate=image,
                                 thresholds=thresholds, reference_png=f"quality/{index:03d}_baseline.png",
                                 candidate_png=f"quality/{index:03d}_candidate.png",
                                 compute_lpips=settings.max_lpips is not None)
        worst_psnr, worst_ssim = min(worst_psnr, compared.psnr_db), min(worst_ssim, compared.ssim)
        row = {"workflow": workflow, "prompt": prompt, "seed": seed, "psnr_db": compared.psnr_db,
               "ssim": compared.ssim, "lpips": compared.lpips, "passed": compared.passed}
        inputs = workflow_fields(Workflow(workflow), size.height, size.width, seed)
        for column, pixels in (("input", inputs.get("init_image")), ("mask", inputs.get("mask")),
                               ("baseline", baseline), ("image", image)):
            if pixels is not None:
                row[column] = f"quality/{index:03d}_{column}.png"
                shown[row[column]] = pixels
        outcome.rows.append(row)
        where = "" if workflow == Workflow.txt2img.value else f" ({workflow})"
        for failure in thresholds.image_failures(compared.psnr_db, compared.ssim, compared.lpips,
                                                 compared.lpips_reason):
            outcome.failures.append(f"prompt {prompt[:40]!r} seed {seed}{where}: {failure}")
        if compared.lpips is None and settings.max_lpips is not None:
            outcome.notes.append(compared.lpips_reason or "LPIPS not computed")
    outcome.figures = {"images": len(images), "size": str(size), "steps": settings.steps,
                       "min_psnr_db": worst_psnr, "min_ssim": worst_ssim,
                       "baseline": str(ctx.baseline.folder), "baseline_created_at": ctx.baseline.created_at}
    _still_draws_the_prompt(ctx, images, outcome)
    psnr = "∞" if worst_psnr == float("inf") else f"{worst_psnr:.1f}"
    outcome.summary = (f"{sum(r['passed'] for r in outcome.rows)}/{len(images)} images match the baseline: worst "
                       f"PSNR {psnr} dB (min {settings.min_psnr_db:g}), SSIM {worst_ssim:.4f} (min {settings.min_ssim:g})")
    return outcome


def _still_draws_the_prompt(ctx: CheckContext, images: dict, outcome: Outcome) -> None:
    """For a micro-model (its folder declares the synthetic world) and prompts of that world: the txt2img images'
    prompt-following figures against the baseline's, within parity's margin (issue 43); else a note."""
    from ...parity.prompt_gate import judge_prompt_following

    keys = [key for key in images if key[0] == Workflow.txt2img.value]
    following, failures = judge_prompt_following(
        ctx.resolved_model.source.path, [key[1] for key in keys], [ctx.baseline.images[key] for key in keys],
        [images[key] for key in keys])
    if following is None:
        outcome.notes.append("still draws the prompt: not applicable (not a synthetic-world micro-model, or "
                             "prompts outside its vocabulary)")
        return
    outcome.figures["prompt_following"] = {"baseline": following.reference, "engine": following.engine}
    outcome.failures += failures


CHECK = Check("quality", "Quality regression", run)
