"""`parity`: every built variant's images against the fp32 PyTorch reference, same prompts and seeds.

A variant is model × target × bucket × LoRA variant × ControlNet. Per variant: the images (PSNR, SSIM,
LPIPS where available), per-component tensor diffs at the bucket's shape (to say *which* engine is
wrong), and the reproducibility checks of the pre-launch checklist (the same request twice gives the same
image; an image does not depend on the rest of its batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..components import Geometry, get_component, load_model_config
from ..engines_file import EnginesConfig, expand
from ..errors import TrtDiffusionError
from ..families import Family, family_info
from ..metrics import Thresholds, tensor_diff, thresholds_for
from ..precision import Precision
from ..runtime.engines import RunnerTable
from ..runtime.loader import BuiltEngine, built_engines, runner_for, table_from_engines
from ..runtime.pipeline import EnginePipeline, GenerationRequest
from ..runtime.reference import reference_runners
from ..sample_inputs import control_image, workflow_inputs
from ..step_cache import PIECES, StepCache, StepCacheMode
from ..workflows import Workflow
from .prompt_gate import judge_prompt_following, parity_prompts
from .report import ComponentDiff, ParityReport, ReportFiles, compare_image, judge_report, judge_variant, write_report

DEFAULT_PROMPTS = (
    "a photograph of an astronaut riding a horse",
    "a watercolor painting of a quiet harbor at dawn",
)
# Largest relative output error (max |diff| / max |ref|) a component engine may show, per precision:
# a localiser for failures; the release gate itself is the image metrics.
COMPONENT_TOLERANCE = {Precision.fp32: 1e-3, Precision.fp16: 2e-2, Precision.bf16: 5e-2, Precision.fp8: 0.5,
                       Precision.int8: 0.5}


@dataclass
class ParityOptions:
    prompts: tuple[str, ...] | None = None  # None: the synthetic world's grid for a micro-model, else DEFAULT_PROMPTS
    seeds: tuple[int, ...] = (0,)
    steps: int = 4
    guidance_scale: float = 7.5
    compute_lpips: bool = True
    strength: float = 0.6  # img2img and inpaint requests: enough kept steps to compare the denoiser's work


@dataclass
class ParityRun:
    report: ParityReport
    files: ReportFiles


def run_parity(config: EnginesConfig, out_dir: Path, options: ParityOptions, *, targets: list[str] | None = None,
               progress: Callable[[str], None] | None = None) -> ParityRun:
    progress = progress or (lambda message: None)
    specs = expand(config)
    variants, images = [], {}
    for model_name, model in config.models.items():
        for target in model.targets:
            if targets and target not in targets:
                continue
            lora_variants = [None] + sorted({s.lora_variant.name for s in specs if s.model == model_name
                                             and s.lora_variant is not None})
            for lora in lora_variants:
                engines = _engines_or_none(config, model_name, target, lora, specs)
                if engines is None:
                    progress(f"{model_name} {target}: not built, skipped")
                    continue
                runners = {engine.spec.key: runner_for(engine) for engine in engines}  # one session per engine
                table = table_from_engines(engines, lambda engine: runners[engine.spec.key])
                reference = _reference(config, model_name, lora)
                for bucket in model.buckets:
                    for controlnet in [None, *sorted(model.controlnets)]:
                        for n, workflow in enumerate(model.workflows):  # each declared workflow, own inputs
                            label = _variant_id(model_name, target, bucket.label, lora, controlnet, workflow)
                            progress(f"parity {label}")
                            result, pngs = _compare_variant(config, model_name, target, bucket, lora, controlnet,
                                                            table, reference, engines, runners, options, label,
                                                            workflow, component_diffs=n == 0)
                            variants.append(result)
                            images.update(pngs)
                    if model.step_cache is not None and _serves_step_cache(table, model.step_cache):
                        # the cached engines against the *uncached* fp32 reference, with the cache's own gate
                        label = _variant_id(model_name, target, bucket.label, lora, None) + "/step-cache"
                        progress(f"parity {label}")
                        result, pngs = _compare_variant(config, model_name, target, bucket, lora, None, table,
                                                        reference, engines, runners, options, label,
                                                        component_diffs=False, step_cache=model.step_cache)
                        variants.append(result)
                        images.update(pngs)
    if not variants:
        raise TrtDiffusionError(_nothing_to_compare(config, targets))
    report = judge_report(variants)
    return ParityRun(report, write_report(report, images, out_dir))


def _engines_or_none(config, model_name, target, lora, specs) -> list[BuiltEngine] | None:
    try:
        return built_engines(config, model_name, target, lora_variant=lora, specs=specs)
    except TrtDiffusionError:
        return None


def _variant_id(model, target, bucket, lora, controlnet, workflow=Workflow.txt2img) -> str:
    parts = [model, target, bucket]
    if lora:
        parts.append(f"lora-{lora}")
    if controlnet:
        parts.append(f"controlnet-{controlnet}")
    if workflow is not Workflow.txt2img:  # txt2img keeps the ids reports had before workflows
        parts.append(workflow.value)
    return "/".join(parts)


def _serves_step_cache(table: RunnerTable, cache: StepCache) -> bool:
    return all(table.has(piece) for piece in PIECES[cache.method])


def _reference(config: EnginesConfig, model_name: str, lora: str | None) -> RunnerTable:
    model = config.models[model_name]
    controlnets = {name: source.path for name, source in model.controlnets.items()}
    # the step cache's pieces in torch too: their engines' tensor diffs (the images are judged uncached)
    table = reference_runners(model.source.path, model.family, components=model.components,
                              controlnets=controlnets or None, step_cache=model.step_cache)
    if lora:
        from ..export.modules import fuse_lora

        denoiser = family_info(model.family).denoiser.value
        entry = next(e for e in table.entries if e.component == denoiser)
        spec = model.loras[lora]
        fuse_lora(entry.runner.module.model, lora, spec.path, spec.scale, denoiser)  # keys `unet.` / `transformer.`
    return table


def judged_precision(model, target: str | None = None) -> Precision:
    """The precision whose bar a variant's images are judged on: the denoiser's, or, in front of a denoiser that is
    not quantized, a quantized text encoder's (a language-model encoder in int8 beside an fp32 transformer). On a
    target, each component's precision there (a family's wide-float default is bf16 where the target builds bf16)."""
    def on_target(component):
        return model.precision[component] if target is None else model.precision_on(component, target)

    denoiser = on_target(family_info(model.family).denoiser)
    if denoiser.is_quantized:
        return denoiser
    quantized = [on_target(c) for c in model.components if on_target(c).is_quantized]
    return quantized[0] if quantized else denoiser


def step_cache_thresholds(cache: StepCache, quantized: Thresholds | None = None) -> Thresholds:
    """The bar of a step-cached variant against the uncached fp32 reference: the cache's own gate; in front of a
    quantized denoiser (`quantized`: that precision's bar, engines.yaml's `parity:` applied), the looser of the two
    per measure. The cached int8 image carries both errors, and each bar is a floor against its own kind of breakage
    (docs/step-cache.md#the-gate): asking the sum of both to clear the stricter one would fail sound engines."""
    min_psnr_db, min_ssim = cache.gate
    if quantized is None:
        return Thresholds(min_psnr_db=min_psnr_db, min_ssim=min_ssim)
    return Thresholds(min_psnr_db=min(min_psnr_db, quantized.min_psnr_db), min_ssim=min(min_ssim, quantized.min_ssim))


def _compare_variant(config, model_name, target, bucket, lora, controlnet, table, reference, engines, runners,
                     options, label, workflow=Workflow.txt2img, component_diffs=True, step_cache=None):
    model = config.models[model_name]
    family = model.family
    denoiser = family_info(family).denoiser
    judged = judged_precision(model, target)
    precision = judged.value
    overrides = model.parity.get(judged)
    thresholds = thresholds_for(precision, overrides.model_dump(exclude_none=True) if overrides else None)
    if step_cache is not None:  # a cache changes the computation by design: its own gate (step_cache.DEFAULT_GATES)
        thresholds = step_cache_thresholds(step_cache, thresholds if judged.is_quantized else None)
    size = bucket.opt
    # text_lengths: a Qwen-Image model's engines.yaml range, where prompts are truncated (None elsewhere)
    engine_pipe = EnginePipeline(model.source.path, family, table, model.workflows, text_lengths=model.text_lengths,
                                 step_cache=step_cache)
    reference_pipe = EnginePipeline(model.source.path, family, reference, model.workflows,
                                    text_lengths=model.text_lengths)
    strength = options.strength if workflow.takes_strength else None
    comparisons, pngs = [], {}
    first_request = first_candidate = None
    schedule = None
    prompts = options.prompts or parity_prompts(model.source.path, DEFAULT_PROMPTS)
    asked, expected_images, candidate_images = [], [], []
    for p, prompt in enumerate(prompts):
        for seed in options.seeds:
            inputs = workflow_inputs(workflow, size.height, size.width, seed)
            request = GenerationRequest(
                prompt=prompt, height=size.height, width=size.width, steps=options.steps,
                guidance_scale=options.guidance_scale, seed=seed, frames=size.frames, controlnet=controlnet,
                control_image=control_image(size.height, size.width, seed) if controlnet else None,
                workflow=workflow.value, strength=strength, **inputs,
                step_cache=None if step_cache is None else StepCacheMode.on.value)
            request = replace(request, negative_prompt=parity_negative_prompt(family, request, engine_pipe.loop))
            generation = engine_pipe.generate(request)
            candidate, schedule = generation.images, generation.timings.step_schedule or schedule
            if first_request is None:
                first_request, first_candidate = request, candidate
            candidate = candidate[0]
            # the reference runs every step whole (no step cache): the uncached fp32 image a cached variant is judged by
            expected = reference_pipe.generate(request).images[0]
            stem = f"{label.replace('/', '__')}__p{p}_s{seed}"
            comparison = compare_image(
                prompt=prompt, seed=seed, reference=expected, candidate=candidate, thresholds=thresholds,
                reference_png=f"{stem}_reference.png", candidate_png=f"{stem}_candidate.png",
                compute_lpips=options.compute_lpips)
            pngs[f"{stem}_reference.png"], pngs[f"{stem}_candidate.png"] = expected, candidate
            shown = {}
            for key, name in (("init_image", "init"), ("mask", "mask")):
                if key in inputs:
                    shown[f"{name}_png"] = f"{stem}_{name}.png"
                    pngs[f"{stem}_{name}.png"] = inputs[key]
            comparisons.append(comparison.model_copy(update=shown))
            asked.append(prompt)
            expected_images.append(expected)
            candidate_images.append(candidate)
    following, following_failures = judge_prompt_following(model.source.path, asked, expected_images,
                                                           candidate_images)
    reproducible = bool(np.array_equal(first_candidate, engine_pipe.generate(first_request).images))
    batch_independent = _batch_independent(engine_pipe, first_request, table, denoiser.value)
    diffs, failures, failing_engines = [], [], []
    if component_diffs:  # the same engines at the same shapes whatever the workflow: once per bucket
        diffs, failures, failing_engines = _component_diffs(model, bucket, engines, runners, reference, controlnet)
    result = judge_variant(
        variant_id=label, model=model_name, target=target, precision=precision, bucket=bucket.label,
        thresholds=thresholds, images=comparisons, components=diffs, reproducible=reproducible,
        batch_independent=batch_independent, lora=lora, controlnet=controlnet,
        extra_failures=failures + following_failures, failing_engines=failing_engines)
    update = {"workflow": workflow.value, "strength": strength, "prompt_following": following}
    if step_cache is not None:
        update.update(step_cache=step_cache.describe(), step_schedule=schedule)
    return result.model_copy(update=update), pngs


def _batch_independent(pipe, request, table, denoiser) -> bool | None:
    """Image 0 of a batch of 2 equals the batch-1 image (needs engines at both batches)."""
    from dataclasses import replace

    batches = table.batches(denoiser, None)
    if not {2, 4} <= batches and None not in batches:
        return None  # no engine for a batch of 2 with CFG: nothing to compare
    one = pipe.generate(request).images[0].astype(int)
    two = pipe.generate(replace(request, batch=2)).images[0].astype(int)
    return bool(np.abs(one - two).max() <= 1)


def _component_diffs(model, bucket, engines: list[BuiltEngine], runners: dict, reference: RunnerTable, controlnet):
    diffs, failures, failing_engines = [], [], []
    for engine, spec in ((e, member) for e in engines for member in e.spec.members):  # each profile's shape
        if spec.bucket not in (None, bucket) or spec.controlnet not in (None, controlnet):
            continue
        component = spec.component
        definition = get_component(model.family, component, spec.piece)
        cn_dir = model.controlnets[spec.controlnet].path if spec.controlnet else None
        model_config = load_model_config(model.source.path, model.family, component, controlnet_dir=cn_dir)
        geometry = Geometry(spec.batch, bucket.opt if spec.bucket else None)
        feeds = definition.dummy_inputs(model_config, dict(spec.build_options), geometry, seed=1)
        got = runners[engine.spec.key].run(feeds)
        ref_runner = reference.find(spec.label, size=None, batch=spec.batch, controlnet=spec.controlnet)
        expected = ref_runner.run({k: v for k, v in feeds.items() if k in ref_runner.inputs})
        for output, value in expected.items():
            diff = tensor_diff(value, got[output])
            diffs.append(ComponentDiff.from_tensor_diff(spec.name, output, diff))
            limit = COMPONENT_TOLERANCE.get(spec.precision, 1e-3)
            if not diff.is_finite or diff.max_rel > limit:
                failures.append(f"component {spec.name} output {output}: max relative error {diff.max_rel:.3g} "
                                f"> {limit:g} (max abs {diff.max_abs:.3g})")
                failing_engines.append(spec.name)
    return diffs, failures, failing_engines


def _nothing_to_compare(config: EnginesConfig, targets: list[str] | None) -> str:
    """Why no variant ran, with the step that would make one: a target the file does not list, a target this
    machine cannot build (a build would build nothing), or engines not built yet."""
    from ..targets import get_target

    listed = list(dict.fromkeys(t for model in config.models.values() for t in model.targets))
    asked = list(targets or listed)
    unlisted = [t for t in asked if t not in listed]
    if unlisted:
        return (f"{config.path} lists no {', '.join(unlisted)} engines (its targets: {', '.join(listed)}); "
                "add the target to the models' `targets:` and build, or choose --target from those")
    unavailable = {t: get_target(t).unavailable_reason() for t in asked}
    if all(unavailable.values()):
        reasons = "; ".join(f"{t}: {reason}" for t, reason in unavailable.items())
        return (f"no built engines to compare in {config.workspace}, and this machine cannot build them ({reasons}); "
                "build them on a host that can (a shared build.workspace) or compare another target")
    buildable = [t for t in asked if not unavailable[t]]
    return (f"no built engines to compare in {config.workspace}; run "
            f"`trt-diffusion build {config.path}" + (f" --target {buildable[0]}" if len(buildable) == 1 else "")
            + "` first")


def parity_negative_prompt(family: Family, request: GenerationRequest, loop) -> str | None:
    """The negative prompt parity's requests carry: the family's declared one (Qwen-Image's true CFG runs only with
    one, diffusers' do_true_cfg: an empty one, so parity compares the engines' second, unconditional transformer call
    too); else an empty one where the model guides only with a negative prompt (a FLUX.1 transformer without a
    guidance embedding: true CFG), so its guided path is the one compared; else None (each family's default)."""
    declared = family_info(family).reference_guidance.get("negative_prompt")
    if declared is not None:
        return declared
    if not loop.runs_cfg(request) and loop.runs_cfg(replace(request, negative_prompt="")):
        return ""
    return None
