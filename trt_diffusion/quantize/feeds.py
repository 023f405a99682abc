"""Map a recorded diffusers denoiser call onto the component's declared ONNX inputs.

The names, order and dims come from `trt_diffusion.components` (the same declarations the fp32 export
uses), so a Q/DQ graph drops into the same engines. The ControlNet residuals of a UNet built for ControlNets are
the call's own where a ControlNet pipeline made it, else zeros: exactly what "no ControlNet" adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..components import (
    MID_RESIDUAL,
    ComponentDef,
    ComponentIO,
    ModelConfig,
    SymbolicDim,
    down_residual_name,
    get_component,
    load_model_config,
    residual_layout,
)
from ..engines_file import ResolvedModel
from ..errors import QuantizeError
from ..families import Component, Family, declared_code, family_info
from .declared_calls import declared_calls

Call = tuple[tuple[Any, ...], dict[str, Any]]  # (args, kwargs) of one denoiser call

# UNet inputs the pipelines may pass positionally: their position in UNet2DConditionModel.forward.
_UNET_POSITIONS = {"sample": 0, "timestep": 1, "encoder_hidden_states": 2}
_PER_SAMPLE_SCALARS = ("timestep", "guidance")  # pipelines may pass these 0-d; engines take one per batch row


@dataclass(frozen=True)
class DenoiserInterface:
    """The declared I/O of one denoiser variant, and how to feed it from a recorded call."""

    family: Family
    component: Component
    definition: ComponentDef
    config: ModelConfig
    options: dict[str, Any]
    io: ComponentIO
    piece: str | None = None  # a step cache's piece of the denoiser (step_cache.PIECES): its graph, not the whole

    @property
    def graph_name(self) -> str:
        """The graph as messages name it: the piece where this is one, else the component."""
        return self.piece or self.component.value

    @property
    def input_names(self) -> list[str]:
        return self.io.input_names

    @property
    def output_name(self) -> str:
        return self.io.output_names[0]

    @property
    def static_shapes(self) -> bool:
        # The legacy exporter bakes FLUX's rotary-embedding reshapes at the traced token count: a FLUX graph
        # with dynamic axes fails at any other shape, so it is exported static (and says so in its manifest).
        return family_info(self.family).static_trace

    def wrapper(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.definition.wrapper(module, self.config, self.options)

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """Legacy-exporter dynamic axes named as the declarations name them (batch, height, image_tokens...)."""
        if self.static_shapes:
            return {}
        axes = {}
        for decl in (*self.io.inputs, *self.io.outputs):
            named = {i: d.name for i, d in enumerate(decl.dims) if isinstance(d, SymbolicDim)}
            if named:
                axes[decl.name] = named
        return axes

    def feeds(self, call: Call) -> dict[str, torch.Tensor]:
        """The declared inputs, in order, as float32 tensors, from one recorded call."""
        args, kwargs = call
        found: dict[str, Any] = {}
        added = kwargs.get("added_cond_kwargs") or {}
        declared = declared_calls(self.family)
        if declared is not None:  # the family's own reading of its pipeline's call (Z-Image's lists)
            found = declared.feeds(call)
        for decl in self.io.inputs if declared is None else ():
            name = decl.name
            if name in kwargs and kwargs[name] is not None:
                found[name] = kwargs[name]
            elif name in _UNET_POSITIONS and len(args) > _UNET_POSITIONS[name]:
                found[name] = args[_UNET_POSITIONS[name]]
            elif name in added:
                found[name] = added[name]
        if self._residual_names():  # a ControlNet's residuals, as the ControlNet pipelines pass them
            for index, residual in enumerate(kwargs.get("down_block_additional_residuals") or ()):
                found[down_residual_name(index)] = residual
            if kwargs.get("mid_block_additional_residual") is not None:
                found[MID_RESIDUAL] = kwargs["mid_block_additional_residual"]
        _adapt_to_declaration(self.family, found, kwargs)
        batch = int(found["sample" if "sample" in found else "hidden_states"].shape[0])
        feeds = {}
        for decl in self.io.inputs:
            value = found.get(decl.name)
            if value is None:
                if decl.name in self._residual_names():
                    value = self._zeros(decl, batch, found)
                else:
                    raise QuantizeError(f"the pipeline's {self.component.value} call has no {decl.name!r}; "
                                        "cannot map it onto the engine inputs")
            value = torch.as_tensor(value).to(torch.int64 if decl.dtype == "int64" else torch.float32)
            if decl.name in _PER_SAMPLE_SCALARS and value.dim() == 0:
                value = value.reshape(1).expand(batch).clone()
            feeds[decl.name] = value
        return feeds

    def pipeline_output(self, output: torch.Tensor, call: Call) -> torch.Tensor:
        """An engine's output in the layout the pipeline expects back: a noise_pred over the patch grid of the call's
        packed tokens (Qwen-Image's [B, h/2, w/2, 64], `quantize_layout`) as the packed [B, T, 64] the call's
        hidden_states have; others as is."""
        if (declared := declared_calls(self.family)) is not None:
            return declared.pipeline_output(output, call)
        args, kwargs = call
        hidden = kwargs.get("hidden_states")
        if family_info(self.family).quantize_layout and hidden is not None and output.dim() != hidden.dim():
            return output.reshape(*hidden.shape[:-1], -1)
        return output

    def _residual_names(self) -> set[str]:
        if not self.options.get("controlnet_residuals"):
            return set()
        return {MID_RESIDUAL} | {down_residual_name(i) for i in range(len(residual_layout(self.config)))}

    def _zeros(self, decl, batch: int, found: dict[str, Any]) -> torch.Tensor:
        sample = found["sample"]
        axes = {"batch": batch, "height": int(sample.shape[2]), "width": int(sample.shape[3]), "tokens": 0}
        return torch.zeros(decl.shape(axes), dtype=torch.float32)


def _adapt_to_declaration(family: Family, found: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """A recorded call's values in the engine's declared layout, where a family's export differs from the pipeline's
    call: its declaration's `quantize_layout` (`flux2_layout`, `qwen_image_layout`)."""
    if (layout := family_info(family).quantize_layout) is not None:
        declared_code(layout)(found, kwargs)


def flux2_layout(found: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """FLUX.2 (components/flux2.py): `img_ids` / `txt_ids` arrive batched [B, N, 4]; the transformer reads the first
    row, the engine takes [N, 4]."""
    for name in ("img_ids", "txt_ids"):
        if found.get(name) is not None and found[name].dim() == 3:
            found[name] = found[name][0]


def qwen_image_layout(found: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Qwen-Image (components/qwen_image.py): the packed tokens [B, T, 64] as their patch grid [B, h/2, w/2, 64]
    (`img_shapes` gives it), and an absent text mask (diffusers' None for an all-ones mask) as the ones it stands
    for."""
    hidden = found["hidden_states"]
    _, rows, cols = kwargs["img_shapes"][0][0]
    found["hidden_states"] = hidden.reshape(hidden.shape[0], rows, cols, hidden.shape[-1])
    if found.get("encoder_hidden_states_mask") is None:
        states = found["encoder_hidden_states"]
        found["encoder_hidden_states_mask"] = torch.ones(states.shape[:2], dtype=torch.int64)


def denoiser_interface(model: ResolvedModel, component: Component | str,
                       piece: str | None = None) -> DenoiserInterface:
    """The denoiser's declared I/O, or that of its step cache's `piece` (the model's `step_cache` decides its cut)."""
    component = Component(component)
    definition = get_component(model.family, component, piece)
    config = load_model_config(model.source.path, model.family, component)
    # A UNet of a model with ControlNets takes their residuals as inputs (see engines_file/expand.py's build options).
    options = {"controlnet_residuals": bool(component is Component.unet and model.controlnets)}
    if piece is not None:
        if model.step_cache is None:
            raise QuantizeError(f"{model.name}: {piece} is a step cache's piece, and the model has no step_cache")
        options["step_cache"] = model.step_cache.engine_option()  # as engines_file/expand.py gives the piece's spec
    return DenoiserInterface(model.family, component, definition, config, options, definition.io(config, options),
                             piece)


def as_numpy(feeds: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: value.detach().cpu().numpy().astype(np.int64 if value.dtype == torch.int64 else np.float32,
                                                       copy=False) for name, value in feeds.items()}
