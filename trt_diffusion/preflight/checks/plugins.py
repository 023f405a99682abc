"""6. Plugin compatibility: every ControlNet through the request on every served bucket; every LoRA on every
built (compiled, quantized) engine variant in process (the served repository carries one LoRA variant). Outputs
must be finite, not black, and visibly changed by the plugin."""

from __future__ import annotations

import numpy as np

from ...errors import TrtDiffusionError
from ...families import family_info
from ...sample_inputs import control_image
from .base import Check, CheckContext, Outcome, mean_abs_diff, workflow_fields, workflow_label


def run(ctx: CheckContext) -> Outcome:
    settings = ctx.settings.plugins
    outcome = Outcome(summary="", thresholds={"min_change": settings.min_change, "min_mean": settings.min_mean})
    for name in ctx.deployment.controlnets:
        for workflow in ctx.workflows:
            for bucket in ctx.deployment.buckets:
                size = bucket.request
                plain = ctx.request(size, workflow, steps=settings.steps, seed=21)
                base = ctx.generate(plain)
                image = ctx.generate(ctx.request(size, workflow, steps=settings.steps, seed=21, controlnet=name,
                                                 control_image=control_image(size.height, size.width, 21),
                                                 controlnet_scale=1.0))
                _judge(outcome, settings, f"ControlNet {name}", bucket.label + workflow_label(workflow),
                       ctx.deployment.kind, base, image, True)
    for lora_name, lora in sorted(ctx.resolved_model.loras.items()):
        for target in ctx.resolved_model.targets:
            _lora_in_process(ctx, outcome, settings, lora_name, lora, target)
    if not outcome.rows:
        return _none(ctx)
    checked = len(outcome.rows)
    outcome.figures = {"plugin_runs": checked, "controlnets": len(ctx.deployment.controlnets),
                       "loras": len(ctx.resolved_model.loras),
                       "min_change_seen": min(r["mean_change"] for r in outcome.rows if r["mean_change"] is not None)}
    outcome.summary = (f"{sum(r['passed'] for r in outcome.rows)}/{checked} plugin runs finite, "
                       f"not black and changed (least change {outcome.figures['min_change_seen']:.2f} grey levels, "
                       f"min {settings.min_change:g})")
    return outcome


def _none(ctx: CheckContext) -> Outcome:
    from .base import not_applicable

    return not_applicable(f"{ctx.model} declares no ControlNet and no LoRA")


def _judge(outcome, settings, plugin, where, via, base, image, finite) -> None:
    change = mean_abs_diff(base, image)
    mean = float(image.mean())
    row = {"plugin": plugin, "where": where, "via": via, "finite": finite, "mean": mean, "mean_change": change}
    outcome.rows.append(row)
    label = f"{plugin} at {where} ({via})"
    before = len(outcome.failures)
    if not finite:
        outcome.failures.append(f"{label}: non-finite engine outputs")
    if mean < settings.min_mean:
        outcome.failures.append(f"{label}: black image (mean grey {mean:.2f} < {settings.min_mean:g})")
    if change < settings.min_change:
        outcome.failures.append(f"{label}: the plugin changed nothing visible (mean |diff| {change:.3f} < "
                                f"{settings.min_change:g} grey levels)")
    row["passed"] = len(outcome.failures) == before


class _FiniteProbe:
    """Wraps a runner and records whether any output was non-finite (images are clipped to uint8 later)."""

    def __init__(self, runner, flags: list):
        self._runner, self._flags = runner, flags
        self.inputs = runner.inputs

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def run(self, feeds):
        outputs = self._runner.run(feeds)
        if any(not np.isfinite(value).all() for value in outputs.values()
               if isinstance(value, np.ndarray) and value.dtype.kind == "f"):
            self._flags.append(True)
        return outputs


def _pipeline(model, engines, make_runner, flags):
    from ...runtime.loader import runner_for, table_from_engines
    from ...runtime.pipeline import EnginePipeline

    make = make_runner or runner_for
    return EnginePipeline(model.source.path, model.family,
                          table_from_engines(engines, lambda e: _FiniteProbe(make(e), flags)), model.workflows,
                          text_lengths=model.text_lengths,  # Qwen-Image's engines.yaml range
                          step_cache=model.step_cache)  # the cached pieces' outputs are probed too


def _lora_in_process(ctx: CheckContext, outcome: Outcome, settings, lora_name: str, lora, target: str) -> None:
    from ...engines_file.schema import LoraMode
    from ...runtime.loader import built_engines, refit_weights, runner_for
    from ...runtime.pipeline import GenerationRequest

    model = ctx.resolved_model
    try:
        base_engines = built_engines(ctx.config, ctx.model, target)
    except TrtDiffusionError as err:
        outcome.notes.append(f"LoRA {lora_name} on {target}: not checked ({err})")
        return
    if lora.mode is LoraMode.fused:
        try:
            lora_engines = built_engines(ctx.config, ctx.model, target, lora_variant=lora_name)
        except TrtDiffusionError as err:
            outcome.failures.append(f"LoRA {lora_name} on {target}: its fused engines are missing ({err})")
            return
        make = None
        kind = "fused"
    else:
        refittable = [e for e in base_engines if e.spec.refittable]
        if not refittable:
            outcome.failures.append(f"LoRA {lora_name} (refit) on {target}: no refittable engine")
            return
        weights = refit_weights(ctx.config, ctx.model, [(lora.path, lora.scale)],
                                refittable={e.spec.component for e in refittable})
        lora_engines = base_engines

        def make(engine):
            part = weights.get(engine.spec.component) if engine.spec.refittable else None
            return runner_for(engine, weights=part)

        kind = "refit"
    denoiser = family_info(model.family).denoiser.value
    precision = next((e.spec.precision for e in lora_engines if e.spec.component == denoiser), "?")
    flags: list = []
    base_pipe = _pipeline(model, base_engines, None, [])
    lora_pipe = _pipeline(model, lora_engines, make, flags)
    for workflow in model.workflows:  # a LoRA combines with every workflow (inpaint + refit LoRA included)
        for bucket in model.buckets:
            if not any(bucket in e.spec.buckets for e in lora_engines):
                continue
            size = bucket.opt
            request = GenerationRequest(prompt="a portrait of a cat", height=size.height, width=size.width,
                                        steps=settings.steps, seed=21, frames=size.frames,
                                        **workflow_fields(workflow, size.height, size.width, 21))
            base = base_pipe.generate(request).images[0]
            image = lora_pipe.generate(request).images[0]
            _judge(outcome, settings, f"LoRA {lora_name}", f"{target} {precision} {bucket.label}"
                   f"{workflow_label(workflow)}", f"in process, {kind}", base, image, not flags)


CHECK = Check("plugins", "Plugin compatibility", run)
