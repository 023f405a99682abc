"""Which engine specs share one ONNX.

An ONNX does not depend on the target, the engine's batch or bucket, or the TensorRT options: one graph
per (model, component, ControlNet, residual inputs, fused-LoRA variant, ONNX precision, opset) serves all
its engines, with dynamic axes covering every bucket and batch of the group; engines fix the shapes.

ONNX precision: the spec's target says which graph its engines need (`Target.onnx_precision`, when the
target declares it): the tensorrt target builds strongly typed, so its bf16 engines get a bf16 graph
(fp32 I/O). Otherwise fp16 specs get an fp16 graph and fp32, bf16, fp8 and int8 specs share the fp32
graph (fp8/int8 Q/DQ graphs are made by the quantize stage).

Frames: a component whose graph fixes the frame count (`fixed_frames`: a video VAE decoder) gets one graph per
frame count, so two buckets of different frames never share its ONNX; every other component's frames are one more
dynamic axis.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..engines_file.engine_spec import EngineSpec, LoraVariant
from ..engines_file.expand import fixed_frames
from ..precision import Precision
from ..workspace.store import hash_inputs

FP16_ONNX = {Precision.fp16}
# Build options that change the exported graph; every other option belongs to later stages.
# step_cache: only a piece's spec has it; context_size/context_tokens: only a Qwen-Image-Edit model's (the reference
# image's resized size and tokens, fixed in its graphs: components/qwen_image_edit.py)
EXPORT_OPTIONS = ("opset", "controlnet_residuals", "step_cache", "context_size", "context_tokens")
DEFAULT_OPSET = 20


def onnx_precision(precision: str, target: str | None = None) -> str:
    """fp32 | fp16 | bf16: the precision of the ONNX a `precision` engine of `target` is exported as."""
    if target is not None:
        from ..errors import TrtDiffusionError
        from ..target_registry import get_target

        try:
            declared = get_target(target).onnx_precision(precision)
        except TrtDiffusionError:  # unknown or unloadable target: the spec check reports it elsewhere
            declared = None
        if declared is not None:
            return declared
    return Precision.fp16 if precision in FP16_ONNX else Precision.fp32


def export_options(spec: EngineSpec) -> dict[str, Any]:
    options = {name: spec.option(name) for name in EXPORT_OPTIONS if spec.option(name) is not None}
    options.setdefault("opset", DEFAULT_OPSET)
    options["controlnet_residuals"] = bool(options.get("controlnet_residuals", False))
    return options


def frame_counts(spec: EngineSpec) -> tuple[int, ...] | None:
    """The frame counts a fixed-frames component's spec spans (one, unless a hand-made spec spans several: the
    export refuses that); None for a component whose frames, if any, are a dynamic axis."""
    if spec.bucket is None or not fixed_frames(spec.family, spec.component):
        return None
    return tuple(sorted({size.frames for member in spec.members for size in (member.bucket.min, member.bucket.max)}))


def export_group_key(spec: EngineSpec) -> str:
    """The identity of the ONNX a spec's engine is built from (16 hex digits)."""
    lora = spec.lora_variant
    fields = {
        "model": spec.model, "family": spec.family, "source": spec.source, "component": spec.component,
        "controlnet": spec.controlnet, "controlnet_source": spec.controlnet_source,
        "lora": [list(s) for s in lora.sources] if lora else None,
        "precision": onnx_precision(spec.precision, spec.target), "options": export_options(spec),
    }
    if (frames := frame_counts(spec)) is not None:  # left out elsewhere: image families keep their keys
        fields["frames"] = list(frames)
    if spec.piece is not None:  # likewise: a step cache's piece is a graph of its own
        fields["piece"] = spec.piece
    return hash_inputs(fields)[:16]


@dataclass(frozen=True)
class ExportGroup:
    """Specs whose engines are built from one ONNX."""

    key: str
    specs: tuple[EngineSpec, ...]

    @property
    def first(self) -> EngineSpec:
        return self.specs[0]

    @property
    def model(self) -> str:
        return self.first.model

    @property
    def family(self) -> str:
        return self.first.family

    @property
    def component(self) -> str:
        return self.first.component

    @property
    def controlnet(self) -> str | None:
        return self.first.controlnet

    @property
    def piece(self) -> str | None:
        return self.first.piece

    @property
    def lora_variant(self) -> LoraVariant | None:
        return self.first.lora_variant

    @property
    def precision(self) -> str:
        return onnx_precision(self.first.precision, self.first.target)

    @property
    def frames(self) -> tuple[int, ...] | None:
        """The frame count(s) the graph is fixed to (see `frame_counts`); None where frames are dynamic."""
        return frame_counts(self.first)

    @property
    def options(self) -> dict[str, Any]:
        return export_options(self.first)

    @property
    def opset(self) -> int:
        return int(self.options["opset"])

    @property
    def name(self) -> str:
        """Readable and unique within a config:
        model.component[.controlnet][+residuals][.lora-x][.Nframes].precision"""
        parts = [self.model, self.piece or self.component]
        if self.controlnet:
            parts.append(self.controlnet)
        if self.options["controlnet_residuals"]:
            parts[-1] += "+residuals"
        if self.lora_variant:
            parts.append(f"lora-{self.lora_variant.name}")
        if self.frames:
            parts.append("-".join(map(str, self.frames)) + "frames")
        parts.append(self.precision)
        return ".".join(parts)


def group_specs(specs: Iterable[EngineSpec]) -> list[ExportGroup]:
    """Groups in first-seen order; specs in each group in their given order."""
    groups: dict[str, list[EngineSpec]] = {}
    for spec in specs:
        groups.setdefault(export_group_key(spec), []).append(spec)
    return [ExportGroup(key, tuple(members)) for key, members in groups.items()]
