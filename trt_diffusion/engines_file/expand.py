"""Expand a resolved engines.yaml into the engine matrix: one EngineSpec per engine to build.

Each component depends on a different subset of the dimensions, and only those make engines:

| component      | bucket | batch                      | ControlNet | fused LoRA |
|----------------|--------|----------------------------|------------|------------|
| text encoders  | no     | image batch (one call each for prompt and negative) | no | no |
| unet/transformer| yes   | denoiser batch (CFG)       | no         | yes        |
| controlnet     | yes    | denoiser batch (CFG)       | each one   | no         |
| vae decoder    | yes    | image batch (CFG-free)     | no         | no         |
| (video)        | × each frame count of the bucket: the whole-clip decoder's frames are fixed (`fixed_frames`) |
| vae encoder    | yes    | 1 (one init image per request, encoded once) | no | no |

The denoiser batch is the image batch doubled when CFG runs batched (cond + uncond in one call).

A target that builds one engine per weight set (TensorRT's `build.tensorrt.engine_layout: profiles`,
`Target.profiles_layout`) gets the per-shape specs of one (model, component, ControlNet, precision, LoRA variant,
target variant) merged into one spec holding a profile per bucket × batch shape (`EngineSpec.profiles`, in the
order above: bucket, then batch); a weight set with one shape stays the per-shape spec, key and all.
"""

from __future__ import annotations

import json

from ..errors import ConfigError
from ..families import Component, EditKind, Family, family_info
from ..step_cache import PIECES
from ..workflows import Workflow
from .engine_spec import Bucket, EngineSpec, LoraVariant, Size
from .load import EnginesConfig, ResolvedModel
from .schema import CfgMode, LoraMode


def fixed_frames(family: Family | str, component: Component | str) -> bool:
    """Whether this component's graph fixes the frame count: a video VAE decoder (and encoder) runs the whole clip in one
    call, and its causal cache, run frame by frame, is unrolled by the exporter over the latent frames, whose count
    it then freezes (dynamo does so silently: docs/video.md). So it gets one ONNX and one engine per frame count, the
    way TensorRT's Wan demo builds it, while the transformer takes a frame range."""
    return Component(component).is_vae and family_info(Family(family)).is_video


def frame_buckets(bucket: Bucket, temporal_factor: int) -> list[Bucket]:
    """A bucket per frame count it spans (frames are 4k+1: one step is `temporal_factor`), each with the bucket's
    width/height range; a bucket of one frame count is itself."""
    if bucket.min.frames == bucket.max.frames:
        return [bucket]
    return [Bucket(*(Size(size.width, size.height, frames) for size in (bucket.min, bucket.opt, bucket.max)))
            for frames in range(bucket.min.frames, bucket.max.frames + 1, temporal_factor)]


def denoiser_batches(model: ResolvedModel) -> dict[int, list[str]]:
    """Denoiser batch -> why it exists, e.g. {2: ['batch 1 × CFG batched']}. `parallel` runs split's calls (two
    instances of the same engine at once), so it wants split's batch: the same spec and key, only the reason differs."""
    batches: dict[int, list[str]] = {}
    for batch in model.batch:
        for mode in model.cfg:
            size = batch * 2 if mode is CfgMode.batched else batch
            why = f"batch {batch} × CFG {mode.value}"
            if mode is CfgMode.parallel:
                why += " (split's engine, two instances at once)"
            batches.setdefault(size, []).append(why)
    return dict(sorted(batches.items()))


def expand(config: EnginesConfig) -> list[EngineSpec]:
    specs: dict[str, EngineSpec] = {}
    for model in config.models.values():
        for spec in _model_specs(config, model):
            existing = specs.get(spec.key)
            if existing:  # the same engine wanted for several reasons: build once, remember all
                reasons = tuple(dict.fromkeys(existing.reasons + spec.reasons))
                spec = EngineSpec(**{**existing.__dict__, "reasons": reasons})
            specs[spec.key] = spec
    return _one_engine_per_weight_set(config, list(specs.values()))  # file order: model, target, component, bucket


def _one_engine_per_weight_set(config: EnginesConfig, specs: list[EngineSpec]) -> list[EngineSpec]:
    """Under a target's profiles layout, the specs that differ only in bucket and batch become one spec with a
    profile each, where the first of them was; every other spec is left as it is."""
    from ..target_registry import get_target

    merging = {name for name in dict.fromkeys(s.target for s in specs) if get_target(name).profiles_layout(config)}
    if not merging:
        return specs
    groups: dict[str, list[EngineSpec]] = {}
    order: list[EngineSpec | str] = []
    for spec in specs:
        if spec.target not in merging:
            order.append(spec)
            continue
        fields = spec.weight_set_fields()
        if fixed_frames(spec.family, spec.component):  # one ONNX per frame count: never one engine over two
            fields["frames"] = spec.bucket.min.frames
        weight_set = json.dumps(fields, sort_keys=True, default=str)
        if weight_set not in groups:
            groups[weight_set] = []
            order.append(weight_set)
        groups[weight_set].append(spec)
    return [entry if isinstance(entry, EngineSpec)
            else groups[entry][0] if len(groups[entry]) == 1 else EngineSpec.with_profiles(groups[entry])
            for entry in order]


def _target_variants(config: EnginesConfig, model: ResolvedModel):
    """(target, its key-affecting options) for every engine variant a target makes of one spec: one for
    most targets; one per GPU architecture for a target that builds per architecture (tensorrt)."""
    from ..target_registry import get_target

    for target in model.targets:
        for options in get_target(target).build_variants(config):
            yield target, options


def reference_grid(model: ResolvedModel, component: Component) -> bool:
    """Whether the component's engines are per bucket because an edit's reference image is: Qwen-Image-Edit's text
    and image encoders (the image's tokens in the prompt), beside its transformer and VAE encoder (per bucket
    anyway). The reference is resized to about 1024² at the bucket's aspect, so each aspect has its grid."""
    return _sees_reference(model, component) and component in (Component.text_encoder, Component.image_encoder)


def _sees_reference(model: ResolvedModel, component: Component) -> bool:
    """A Qwen-Image-Edit component whose graph the reference image shapes (all but the VAE decoder)."""
    return (family_info(model.family).edit is EditKind.vision_reference and Workflow.edit in model.workflows
            and component in (Component.text_encoder, Component.image_encoder, Component.transformer,
                              Component.vae_encoder))


def reference_size(model: ResolvedModel, bucket: Bucket) -> str:
    return _edit_context(model, bucket)["context_size"]


def _edit_context(model: ResolvedModel, bucket: Bucket) -> dict[str, str]:
    from ..models.edit_reference import context_options, image_processor_config

    return context_options(bucket.opt.width, bucket.opt.height, image_processor_config(model.source.path))


def _build_options(config: EnginesConfig, model: ResolvedModel, variant: dict, component: Component,
                   bucket: Bucket | None = None):
    options = {"opset": config.build.opset, **variant}
    if bucket is not None and _sees_reference(model, component):
        options.update(_edit_context(model, bucket))  # the reference image's size and tokens, fixed in the graphs
    if component is Component.unet and model.controlnets:
        options["controlnet_residuals"] = True  # the UNet takes the ControlNet's residuals as extra inputs
    if (component is Component.transformer and Workflow.edit in model.workflows
            and family_info(model.family).edit is EditKind.context_tokens):
        options["context_image"] = True  # Kontext: the init image's tokens beside the noise tokens
    if model.text_lengths is not None and (component.is_text_encoder or component.is_denoiser):
        options["text_length"] = ",".join(map(str, model.text_lengths))  # the text axis's profile (qwen_image)
    if model.step_cache is not None and component.is_denoiser:
        # where the UNet is cut (deepcache's branch) changes the pieces' graphs; the uncached engine ignores it
        options["step_cache"] = model.step_cache.engine_option()
    if model.precision[component].is_quantized:
        options["quantization"] = json.dumps(model.quantization.model_dump(mode="json"), sort_keys=True)
    return tuple(sorted(options.items()))


def _model_specs(config: EnginesConfig, model: ResolvedModel):
    cfg_batches = denoiser_batches(model)
    image_batches = {b: [f"batch {b}"] for b in model.batch}
    fused = [None] + [
        LoraVariant(name, ((name, f"file:{lora.path.name}", lora.scale),))
        for name, lora in sorted(model.loras.items()) if lora.mode is LoraMode.fused
    ]
    for target, variant in _target_variants(config, model):
        def make(component, batch, bucket, reasons, source=model.source.identity, variant=variant, target=target,
                 **extra):
            options = _build_options(config, model, variant, component, bucket)
            if extra.get("piece") is None:
                # the uncached denoiser ignores the step cache: adding or changing `step_cache:` must not rebuild
                # the engine every uncached step (and STEP_CACHE=off) runs
                options = tuple(item for item in options if item[0] != "step_cache")
            return EngineSpec(
                model=model.name, family=model.family, source=source,
                component=component, target=target, precision=model.precision_on(component, target),
                batch=batch, bucket=bucket, build_options=options, reasons=tuple(reasons), **extra,
            )

        for component in model.components:
            if reference_grid(model, component):  # Qwen-Image-Edit's encoders: one reference grid per bucket
                for bucket in model.buckets:
                    yield make(component, 1, bucket, [f"bucket {bucket.label} × the reference image "
                                                       f"({reference_size(model, bucket)})"])
            elif component.is_text_encoder:  # prompt and negative prompt are encoded in separate calls
                # a refittable model's LoRA-capable (CLIP) text encoders take a LoRA's text-encoder part by refit
                te_refit = model.refittable and component in family_info(model.family).lora_text_encoders
                for batch, why in image_batches.items():
                    yield make(component, batch, None, why, refittable=te_refit)
            elif component.is_denoiser:
                for variant in fused:
                    for bucket in model.buckets:
                        for batch, why in cfg_batches.items():
                            lora_why = f" × fused LoRA {variant.name}" if variant else ""
                            reasons = [f"bucket {bucket.label} × {w}{lora_why}" for w in why]
                            yield make(component, batch, bucket, reasons, lora_variant=variant,
                                       refittable=model.refittable and variant is None)
                            for piece in PIECES[model.step_cache.method] if model.step_cache else ():
                                yield make(component, batch, bucket,
                                           [f"{r} × step cache {model.step_cache.describe()}" for r in reasons],
                                           lora_variant=variant, refittable=model.refittable and variant is None,
                                           piece=piece)
            elif component is Component.image_encoder:  # the conditioning image, once per request
                uses = [w.value for w in model.workflows if w.encodes_image] or ["listed in components"]
                yield make(component, 1, None, [f"init image ({', '.join(uses)})"])
            elif component.is_vae:
                temporal = family_info(model.family).temporal_factor
                encoder = component is Component.vae_encoder  # the init image, once per request (rows repeat it)
                uses = [w.value for w in model.workflows if w.encodes_image] or ["listed in components"]
                batches = {1: [f"init image ({', '.join(uses)})"]} if encoder else image_batches
                for bucket in model.buckets:
                    split = frame_buckets(bucket, temporal) if fixed_frames(model.family, component) else [bucket]
                    for engine_bucket in split:
                        where = f"bucket {bucket.label}" + (
                            f" × {engine_bucket.min.frames} frames (the whole-clip VAE fixes its frame count)"
                            if len(split) > 1 else "")
                        for batch, why in batches.items():
                            yield make(component, batch, engine_bucket, [f"{where} × {w}" for w in why])
            else:  # a component added to families.py without an engine rule here
                raise ConfigError(f"{model.name}: no engine rule for the {model.family.value} {component.value}")
        for cn_name, cn_source in sorted(model.controlnets.items()):
            for bucket in model.buckets:
                for batch, why in cfg_batches.items():
                    yield make(Component.controlnet, batch, bucket,
                               [f"ControlNet {cn_name} × bucket {bucket.label} × {w}" for w in why],
                               controlnet=cn_name, controlnet_source=cn_source.identity,
                               source=cn_source.identity)  # independent of the base model's weights
