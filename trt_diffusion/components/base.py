"""What every component declaration provides, and the shape arithmetic they share.

A component declares its tensors with *symbolic* dims. Each symbolic dim is a multiple of one of five
axes: the batch, the latent height, the latent width, (FLUX) the number of packed image tokens, or (video
families) the number of latent frames.
A component whose text length is a profile dimension (Qwen-Image's language-model encoder and the transformer
that attends to its states) also has a `text` axis (`TEXT_AXIS`): its prompt tokens, ranged by
`ComponentDef.text_lengths`; it is kept out of AXES so every other export's shapes (and hash) stay as they were.
From a `Geometry` (a batch and a pixel size) every dim gets its value; from a set of geometries the
exporter derives the dynamic ranges, the engines their profiles.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ..engines_file.engine_spec import EngineSpec, Size
from ..families import Component, Family, family_info
from .model_config import ModelConfig

Shape = tuple[int, ...]
ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]

AXES = ("batch", "height", "width", "tokens", "frames")
TEXT_AXIS = "text"  # prompt tokens, where a component's text length is dynamic (ComponentDef.text_lengths)


@dataclass(frozen=True)
class SymbolicDim:
    """An ONNX dim name and how it follows from an axis: size = scale × axis value + offset."""

    name: str
    axis: str  # one of AXES
    scale: Fraction = Fraction(1)
    offset: int = 0  # a causal video VAE's frames: 4 × latent frames - 3


@dataclass(frozen=True)
class TensorDecl:
    """One input or output of the exported graph."""

    name: str
    dtype: str  # numpy dtype name: float32 / int64
    dims: tuple[int | SymbolicDim, ...]

    def shape(self, axis_values: Mapping[str, int]) -> Shape:
        return tuple(d if isinstance(d, int) else _dim_value(d, axis_values) for d in self.dims)

    def dim_names(self) -> tuple[int | str, ...]:
        """The shape as ONNX writes it: fixed sizes as ints, dynamic ones by name."""
        return tuple(d if isinstance(d, int) else d.name for d in self.dims)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dim_names())}


def _dim_value(dim: SymbolicDim, axis_values: Mapping[str, int]) -> int:
    value = dim.scale * axis_values[dim.axis] + dim.offset
    if value.denominator != 1:
        raise ValueError(f"dim {dim.name} = {dim.scale} × {dim.axis} {axis_values[dim.axis]} is not an integer")
    return int(value)


BATCH = SymbolicDim("batch", "batch")
HEIGHT = SymbolicDim("height", "height")
WIDTH = SymbolicDim("width", "width")
LATENT_FRAMES = SymbolicDim("latent_frames", "frames")  # video: (F - 1) / temporal factor + 1


def image_dims(vae_scale_factor: int) -> tuple[SymbolicDim, SymbolicDim]:
    """Pixel height/width as multiples of the latent axes."""
    return (SymbolicDim("image_height", "height", Fraction(vae_scale_factor)),
            SymbolicDim("image_width", "width", Fraction(vae_scale_factor)))


@dataclass(frozen=True)
class Geometry:
    """One concrete call: a batch and, for resolution-dependent components, a pixel size."""

    batch: int
    size: Size | None = None
    text: int = 0  # prompt tokens (the `text` axis), for a component with dynamic text length; 0: none

    def label(self) -> str:
        return f"batch {self.batch}" + (f", {self.size}" if self.size else "") + (
            f", {self.text} text tokens" if self.text else "")


@dataclass(frozen=True)
class ComponentIO:
    inputs: tuple[TensorDecl, ...]
    outputs: tuple[TensorDecl, ...]
    image_outputs: tuple[str, ...] = field(default=())  # outputs that are pixels in [-1, 1] (PSNR is gated)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def to_json(self) -> dict:
        return {"inputs": [t.to_json() for t in self.inputs], "outputs": [t.to_json() for t in self.outputs],
                "image_outputs": list(self.image_outputs)}


class ComponentDef(ABC):
    """The declarative description of one component kind of one family."""

    kind: str  # a stable name for the declaration (part of the export's input hash)
    version: int = 1  # bump when the wrapper or the I/O of this kind changes: invalidates cached exports
    legacy_trace: bool = False  # exported by the TorchScript tracer (static shapes only): the class says why

    def __init__(self, family: Family, component: Component):
        self.family, self.component = family, component

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.family.value}.{self.component.value})"

    # --- what the graph looks like -----------------------------------------------------------

    @abstractmethod
    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        """Input and output declarations. `options` are the spec's build options (controlnet_residuals...)."""

    @property
    def resolution_dependent(self) -> bool:
        return True

    def spatial_alignment(self, config: ModelConfig) -> int:
        """Latent height/width must be multiples of this (downsampling stages, patch sizes)."""
        return 1

    def axis_values(self, config: ModelConfig, geometry: Geometry) -> dict[str, int]:
        values = {"batch": geometry.batch}
        if geometry.size is not None:
            height, width = geometry.size.latent(config.vae_scale_factor)
            values.update(height=height, width=width, tokens=self.tokens(config, height, width),
                          frames=geometry.size.latent_frames(family_info(self.family).temporal_factor))
        lengths = self.text_lengths(config)
        if lengths is not None:  # a geometry that does not say takes the profile's opt
            values[TEXT_AXIS] = geometry.text or lengths[1]
        return values

    def text_lengths(self, config: ModelConfig, options: Mapping[str, Any] | None = None) -> tuple[int, int, int] | None:
        """(min, opt, max) prompt tokens where the text length is a profile dimension (the `text` axis: the spec's
        `text_length` build option, else the family's); None where it is fixed (`config.sequence_length`: every other
        family pads prompts to one length)."""
        return None

    def tokens(self, config: ModelConfig, latent_height: int, latent_width: int) -> int:
        """The packed-token axis (only FLUX uses it)."""
        return 0

    def attention_score_bytes(self, config: ModelConfig, geometry: Geometry) -> int | None:
        """Bytes of one fp32 self-attention score tensor at `geometry` (batch × heads × tokens²), the largest
        activation an unfused runtime (the export check's ONNX Runtime session) materializes; None where the
        component does not say. The export checks a component whose scores would pass a budget at smaller
        shapes of the same dynamic graph (export/shapes.py)."""
        return None

    # --- torch side --------------------------------------------------------------------------

    @abstractmethod
    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        """An eval-mode nn.Module whose forward takes the declared inputs in order (float32 / int64)
        and returns the declared outputs in order (float32). `compute_dtype` (torch.float16) runs the
        module in that dtype; the module must already be converted."""

    @abstractmethod
    def dummy_inputs(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry,
                     seed: int = 0) -> dict[str, np.ndarray]:
        """Seeded inputs in the value ranges the pipeline feeds."""

    def export_context(self) -> contextlib.AbstractContextManager:
        """Adjustments active only while tracing (the parity reference runs the unmodified module)."""
        return contextlib.nullcontext()

    # --- shapes ------------------------------------------------------------------------------

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, Shape]:
        values = self.axis_values(config, geometry)
        return {t.name: t.shape(values) for t in self.io(config, options).inputs}

    def profile(self, spec: EngineSpec, model_config: ModelConfig) -> ProfileShapes:
        """Input name -> (min, opt, max) shape of the engine `spec` describes (its batch is fixed)."""
        options = dict(spec.build_options)
        texts = self.text_lengths(model_config, options) or (0, 0, 0)
        if spec.bucket is None or not self.resolution_dependent:
            if texts[0]:  # the text length is the one dimension of this profile
                low, opt, high = (self.shapes(model_config, options, Geometry(spec.batch, text=t)) for t in texts)
                return {name: (low[name], opt[name], high[name]) for name in low}
            one = self.shapes(model_config, options, Geometry(spec.batch))
            return {name: (shape, shape, shape) for name, shape in one.items()}
        low, opt, high = (self.shapes(model_config, options, Geometry(spec.batch, size, text))
                          for size, text in zip((spec.bucket.min, spec.bucket.opt, spec.bucket.max), texts))
        return {name: (low[name], opt[name], high[name]) for name in low}


class ExportWrapper(torch.nn.Module):
    """The module the exporter traces: declared inputs in, declared outputs out.

    Holds the component as `model` (the exporter names its parameters `model.<name>`; the graph
    passes strip the prefix so initializers carry the component's own parameter names). Inputs arrive
    as float32/int64 and floats are cast to `compute_dtype` (fp16 exports); outputs leave as float32,
    so a graph's I/O contract does not depend on its precision. `forward` takes the inputs positionally
    in declaration order (a variable count: the UNet's ControlNet residuals) and hands them to `compute`
    by name.
    """

    PARAMETER_PREFIX = "model."

    def __init__(self, model: torch.nn.Module, input_names: list[str], compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.compute_dtype = compute_dtype or torch.float32

    def cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.compute_dtype) if tensor.is_floating_point() else tensor

    def forward(self, *inputs: torch.Tensor):
        outputs = self.compute(**dict(zip(self.input_names, inputs)))
        if isinstance(outputs, torch.Tensor):
            return outputs.float()
        return tuple(o.float() for o in outputs)

    def compute(self, **inputs: torch.Tensor):
        raise NotImplementedError


# --- dummy-input helpers shared by the declarations ------------------------------------------


def rng(seed: int, geometry: Geometry) -> np.random.Generator:
    """One generator per (seed, geometry): the same call gets the same inputs in any process."""
    size = (geometry.size.width, geometry.size.height) if geometry.size else (0, 0)
    if geometry.size is not None and geometry.size.frames:  # images keep the seeds they always had
        size = (*size, geometry.size.frames)
    if geometry.text:  # likewise: only dynamic-text geometries seed with their length
        size = (*size, geometry.text)
    return np.random.default_rng([seed, geometry.batch, *size])


def normal(gen: np.random.Generator, shape: Shape, scale: float = 1.0) -> np.ndarray:
    return (gen.standard_normal(shape) * scale).astype(np.float32)


def timesteps(gen: np.random.Generator, batch: int, high: float = 1000.0) -> np.ndarray:
    return gen.uniform(0.0, high, size=(batch,)).astype(np.float32)
