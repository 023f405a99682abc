"""`plan`: what engines.yaml asks for — engine counts per model and component, why, and disk estimates."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .engines_file import EnginesConfig, EngineSpec, Precision, expand
from .engines_file.expand import fixed_frames
from .errors import TrtDiffusionError
from .families import Component, EditKind, family_info
from .workflows import Workflow


@dataclass
class PlanRow:
    model: str
    component: str
    target: str
    precision: str
    engines: int
    parameters: int | None
    bytes_per_engine: int | None
    why: list[str] = field(default_factory=list)
    formula: str = ""
    runs_as: str = ""  # what the target computes for this precision, here and on other hosts
    not_here: str | None = None  # why this machine cannot build the row's engines (None: it can)
    layouts: dict[str, int] | None = None  # device weight bytes per engine layout, where the target has several
    # TensorRT: activation memory per served instance (contexts, and bytes once built), under Triton's TensorRT
    # backend and under trt-diffusion's runner (targets/tensorrt/served_memory.py)
    activations: dict[str, int | None] | None = None

    @property
    def disk_bytes(self) -> int | None:
        return None if self.bytes_per_engine is None else self.bytes_per_engine * self.engines


@dataclass
class Plan:
    config: EnginesConfig
    specs: list[EngineSpec]
    rows: list[PlanRow]
    workflows: dict[str, dict[str, str]] = field(default_factory=dict)  # model -> workflow -> what it adds

    @property
    def total_engines(self) -> int:
        return len(self.specs)

    @property
    def buildable_here(self) -> int:
        return sum(r.engines for r in self.rows if r.not_here is None)

    @property
    def total_disk_bytes(self) -> int:
        return sum(r.disk_bytes or 0 for r in self.rows)

    def count(self, model: str, component: str, target: str | None = None) -> int:
        return sum(1 for s in self.specs
                   if s.model == model and s.component == component and (target is None or s.target == target))

    def to_json(self) -> dict:
        return {
            "config": str(self.config.path),
            "total_engines": self.total_engines,
            "buildable_here": self.buildable_here,
            "total_disk_bytes": self.total_disk_bytes,
            "workflows": self.workflows,
            "rows": [{**r.__dict__, "disk_bytes": r.disk_bytes} for r in self.rows],
            "engines": [
                {"key": s.key, "name": s.name, "model": s.model, "component": s.component, "piece": s.piece,
                 "target": s.target,
                 "precision": s.precision, "batch": s.batch, "bucket": s.bucket.to_json() if s.bucket else None,
                 "controlnet": s.controlnet, "lora": s.lora_variant.name if s.lora_variant else None,
                 "refittable": s.refittable, "reasons": list(s.reasons),
                 # engine_layout: profiles — the (bucket, batch) of each optimization profile; [] for one shape
                 "profiles": [{"bucket": m.bucket.to_json() if m.bucket else None, "batch": m.batch}
                              for m in s.members] if s.profiles else []}
                for s in self.specs
            ],
        }


def make_plan(config: EnginesConfig, count_parameters: bool = True) -> Plan:
    specs = expand(config)
    groups: dict[tuple, list[EngineSpec]] = defaultdict(list)
    for spec in specs:
        groups[(spec.model, spec.component, spec.controlnet, spec.target, spec.precision, spec.piece)].append(spec)
    rows = []
    order = {c.value: i for i, c in enumerate(Component)}
    groups = dict(sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][3], order[kv[0][1]], kv[0][2] or "",
                                                         kv[0][5] or "")))
    for (model_name, component, controlnet, target, precision, piece), members in groups.items():
        params = _parameters(config, model_name, Component(component), controlnet) if count_parameters else None
        per_engine = int(params * Precision(precision).bytes_per_parameter) if params is not None else None
        label = f"{component}:{controlnet}" if controlnet else piece or component
        why = [r for s in members for r in s.reasons]
        rows.append(PlanRow(model_name, label, target, precision, len(members), params, per_engine, why,
                            formula=_formula(members), runs_as=_runs_as(target, precision),
                            not_here=_not_here(target), layouts=_layouts(target, members, per_engine),
                            activations=_activations(config, target, members)))
    return Plan(config, specs, rows, {name: workflow_notes(model, specs) for name, model in config.models.items()})


def workflow_notes(model, specs: list[EngineSpec]) -> dict[str, str]:
    """What each declared workflow adds to the model's engines, in words."""
    denoiser = family_info(model.family).denoiser.value
    checkpoint = model.checkpoint
    encoders = sum(1 for s in specs if s.model == model.name and s.component == Component.vae_encoder)
    encoder = f"the VAE encoder ({encoders} engine{'s' if encoders != 1 else ''}: one per bucket and target, batch 1)"
    notes = {}
    for workflow in model.workflows:
        if workflow is Workflow.txt2img:
            notes[workflow.value] = f"the text-to-{'video' if family_info(model.family).is_video else 'image'} engines"
        elif workflow is Workflow.img2img:
            notes[workflow.value] = f"{encoder}; the same {denoiser} engines over the schedule strength keeps"
        elif workflow is Workflow.inpaint:
            if checkpoint is not None and checkpoint.inpainting:
                how = (f"the checkpoint's {checkpoint.denoiser_channels}-channel inpainting {denoiser} (mask and "
                       "masked-image latents as extra input channels)")
            else:
                channels = f"{checkpoint.denoiser_channels}-channel " if checkpoint and checkpoint.denoiser_channels else ""
                how = f"mask blending on the {channels}{denoiser}, as diffusers does for non-inpainting checkpoints"
            notes[workflow.value] = f"{encoder}; {how}"
        elif workflow is Workflow.img2vid:
            image = ("the CLIP image encoder (1 engine, batch 1) whose embeddings the transformer attends to; "
                     if checkpoint is not None and checkpoint.image_encoder else "")
            notes[workflow.value] = (f"{image}{encoder.replace('bucket', 'bucket frame count')} over the image "
                                     f"followed by black frames; the {denoiser}'s {checkpoint.denoiser_channels if checkpoint else 36}"
                                     " input channels carry the noise, the first-frame mask and those latents")
        elif family_info(model.family).edit is EditKind.vision_reference:
            notes[workflow.value] = (f"the reference image at about 1024² of the bucket's aspect: {encoder} over it; "
                                     "Qwen2.5-VL's vision tower (image_encoder) and the text encoder over its tokens, "
                                     f"both per bucket (batch 1); the {denoiser} over its latent tokens beside the "
                                     "noise tokens")
        else:
            notes[workflow.value] = (f"{encoder}; the {denoiser} over the init image's tokens beside the noise "
                                     "tokens (twice the image-token sequence)")
    return notes


def _layouts(target: str, members: list[EngineSpec], per_engine: int | None) -> dict[str, int] | None:
    from .targets import get_target

    if per_engine is None:
        return None
    try:
        return get_target(target).layout_memory(members, per_engine)
    except TrtDiffusionError:  # a target that cannot load is reported by `build`, not here
        return None


def _activations(config: EnginesConfig, target: str, members: list[EngineSpec]) -> dict[str, int | None] | None:
    """The activation memory per served instance of a row's engines, where the target reports it (TensorRT)."""
    from .targets import get_target

    try:
        return get_target(target).activation_memory(members, Path(config.workspace))
    except TrtDiffusionError:  # a target that cannot load is reported by `build`, not here
        return None


def _not_here(target: str) -> str | None:
    """Why this machine cannot build a target's engines (`build` skips them), or None."""
    from .targets import get_target

    return get_target(target).unavailable_reason()


def _runs_as(target: str, precision: str) -> str:
    """A target that computes something host-dependent says what (its `plan_note`)."""
    from .targets import get_target

    try:
        chosen = get_target(target)
    except Exception:  # noqa: BLE001 - a target that cannot load is reported by `build`, not here
        return ""
    return chosen.plan_note(precision)


def _formula(members: list[EngineSpec]) -> str:
    """How the count comes about, e.g. '3 buckets × 2 batch shapes (1, 2)'."""
    def distinct(values):
        return list(dict.fromkeys(values))

    engines = len(members)
    members = [m for s in members for m in s.members]  # a multi-profile engine counts its shapes
    buckets = distinct(s.bucket.label for s in members if s.bucket)
    batches = distinct(s.batch for s in members)
    variants = distinct(s.lora_variant.name if s.lora_variant else "base" for s in members)
    parts = []
    if buckets:
        parts.append(f"{len(buckets)} bucket{'s' if len(buckets) > 1 else ''} ({', '.join(buckets)})")
    parts.append(f"{len(batches)} batch shape{'s' if len(batches) > 1 else ''} ({', '.join(map(str, batches))})")
    if len(variants) > 1:
        parts.append(f"{len(variants)} LoRA variants ({', '.join(variants)})")
    architectures = distinct(s.option("architecture") for s in members if s.option("architecture"))
    if architectures:
        parts.append(f"{len(architectures)} GPU architecture{'s' if len(architectures) > 1 else ''} "
                     f"({', '.join(architectures)})")
    text = " × ".join(parts)
    frames = distinct(s.bucket.min.frames for s in members if s.bucket and fixed_frames(s.family, s.component))
    if frames:
        text += f"; each engine at one frame count ({', '.join(map(str, frames))}: the whole-clip VAE fixes it)"
    if engines < len(members):  # engine_layout: profiles
        text += f" shapes as {engines} engine{'s' if engines > 1 else ''} with a profile per shape"
    return text


# The modules of the VAE each part exports (as models.loading.count_parameters counts them).
_VAE_PARTS = {Component.vae_encoder: ("encoder.", "quant_conv."), Component.vae_decoder: ("decoder.", "post_quant_conv.")}


def _parameters(config: EnginesConfig, model_name: str, component: Component, controlnet: str | None) -> int | None:
    """From the safetensors headers (no torch: `plan` answers at once); from the config on torch's meta
    device only for a folder without safetensors weights."""
    from .families import SUBFOLDER
    from .models.weight_headers import stored_parameter_count

    model = config.models[model_name]
    if not Path(model.source.path).is_dir():
        return None
    folder = model.controlnets[controlnet].path if controlnet else Path(model.source.path) / SUBFOLDER[component]
    # a checkpoint folder that holds more than its engine (a language model's vision tower, LM head): the family
    # declares the parts its engine holds
    parts = family_info(model.family).engine_parts.get(component, _VAE_PARTS.get(component))
    count = stored_parameter_count(folder, parts)
    if count is not None:
        return count
    from .models.loading import parameter_count

    return parameter_count(model.source.path, component, model.controlnets[controlnet].path if controlnet else None)
