"""SD1.5 / SDXL ControlNet: the UNet's conditioning plus a control image in, the UNet's residuals out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import BATCH, ComponentDef, ComponentIO, ExportWrapper, TensorDecl, image_dims, rng
from .model_config import ModelConfig
from .unet import (
    added_cond_kwargs,
    conditioning_inputs,
    conditioning_values,
    downsampling_alignment,
    residual_decls,
)


class _ControlNetWrapper(ExportWrapper):
    def compute(self, **inputs: torch.Tensor):
        down, mid = self.model(
            self.cast(inputs["sample"]), self.cast(inputs["timestep"]), self.cast(inputs["encoder_hidden_states"]),
            controlnet_cond=self.cast(inputs["controlnet_cond"]),
            conditioning_scale=self.cast(inputs["conditioning_scale"]),
            added_cond_kwargs=added_cond_kwargs(inputs), return_dict=False,
        )
        return (*down, mid)


class ControlNet(ComponentDef):
    """ControlNetModel -> `down_block_residual_0..N-1`, `mid_block_residual` (the UNet's residual inputs).

    Inputs: `sample`, `timestep`, `encoder_hidden_states` (as the UNet), `controlnet_cond` [B,3,H,W] pixels in
    [0, 1], `conditioning_scale` [1]; SDXL adds `text_embeds` and `time_ids`.
    """

    kind = "controlnet"

    def spatial_alignment(self, config: ModelConfig) -> int:
        return downsampling_alignment(config)

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        image_height, image_width = image_dims(config.vae_scale_factor)
        inputs = conditioning_inputs(config) + (
            TensorDecl("controlnet_cond", "float32", (BATCH, 3, image_height, image_width)),
            TensorDecl("conditioning_scale", "float32", (1,)),
        )
        return ComponentIO(inputs=inputs, outputs=residual_decls(config))

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _ControlNetWrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        io = self.io(config, options)
        gen = rng(seed, geometry)
        values = conditioning_values(config, io, geometry, gen, self)
        shape = io.inputs[io.input_names.index("controlnet_cond")].shape(self.axis_values(config, geometry))
        values["controlnet_cond"] = gen.uniform(0.0, 1.0, size=shape).astype("float32")
        values["conditioning_scale"] = gen.uniform(0.5, 1.0, size=(1,)).astype("float32")
        return {name: values[name] for name in io.input_names}
