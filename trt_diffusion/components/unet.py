"""SD1.5 / SDXL UNet, and the ControlNet residual layout it shares with the ControlNet.

The residual names are the contract between the two graphs: the ControlNet's outputs are the UNet's
inputs `down_block_residual_0..N-1` and `mid_block_residual`.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from .base import (
    BATCH,
    HEIGHT,
    WIDTH,
    ComponentDef,
    ComponentIO,
    ExportWrapper,
    Geometry,
    SymbolicDim,
    TensorDecl,
    normal,
    rng,
    timesteps,
)
from .model_config import ModelConfig

MID_RESIDUAL = "mid_block_residual"


def down_residual_name(index: int) -> str:
    return f"down_block_residual_{index}"


def spatial_dims(level: int) -> tuple[SymbolicDim, SymbolicDim]:
    """Latent height/width after `level` 2x downsamplings."""
    if level == 0:
        return HEIGHT, WIDTH
    factor = 2**level
    return (SymbolicDim(f"height_div{factor}", "height", Fraction(1, factor)),
            SymbolicDim(f"width_div{factor}", "width", Fraction(1, factor)))


def residual_layout(config: ModelConfig) -> list[tuple[int, int]]:
    """(channels, downsampling level) of each down-block residual, as ControlNetModel emits them:
    conv_in's output, then each resnet of each down block, then each block's downsampler but the last's."""
    channels = list(config["block_out_channels"])
    layers = config["layers_per_block"]
    layers = [layers] * len(channels) if isinstance(layers, int) else list(layers)
    layout = [(channels[0], 0)]
    for level, (width, count) in enumerate(zip(channels, layers)):
        layout += [(width, level)] * count
        if level < len(channels) - 1:
            layout.append((width, level + 1))
    return layout


def residual_decls(config: ModelConfig) -> tuple[TensorDecl, ...]:
    decls = []
    for index, (channels, level) in enumerate(residual_layout(config)):
        decls.append(TensorDecl(down_residual_name(index), "float32", (BATCH, channels, *spatial_dims(level))))
    deepest = len(config["block_out_channels"]) - 1
    decls.append(TensorDecl(MID_RESIDUAL, "float32", (BATCH, config["block_out_channels"][-1], *spatial_dims(deepest))))
    return tuple(decls)


def downsampling_alignment(config: ModelConfig) -> int:
    return 2 ** (len(config["block_out_channels"]) - 1)


def cross_attention_dim(config: ModelConfig) -> int:
    value = config["cross_attention_dim"]
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def has_text_time(config: ModelConfig) -> bool:
    """SDXL's added conditioning: pooled text embeddings and six size/crop ids."""
    return config.get("addition_embed_type") == "text_time"


def text_time_decls(config: ModelConfig) -> tuple[TensorDecl, ...]:
    pooled = int(config["projection_class_embeddings_input_dim"]) - 6 * int(config["addition_time_embed_dim"])
    return (TensorDecl("text_embeds", "float32", (BATCH, pooled)), TensorDecl("time_ids", "float32", (BATCH, 6)))


def conditioning_inputs(config: ModelConfig) -> tuple[TensorDecl, ...]:
    """What a UNet and its ControlNet both take: latents, timestep, text (and SDXL's added conditions)."""
    sample = TensorDecl("sample", "float32", (BATCH, int(config["in_channels"]), HEIGHT, WIDTH))
    decls = (sample, TensorDecl("timestep", "float32", (BATCH,)),
             TensorDecl("encoder_hidden_states", "float32", (BATCH, config.sequence_length, cross_attention_dim(config))))
    return decls + (text_time_decls(config) if has_text_time(config) else ())


def conditioning_values(config: ModelConfig, io: ComponentIO, geometry: Geometry, gen: np.random.Generator,
                        component: ComponentDef) -> dict[str, np.ndarray]:
    shapes = {t.name: t.shape(component.axis_values(config, geometry)) for t in io.inputs}
    values = {"sample": normal(gen, shapes["sample"]), "timestep": timesteps(gen, geometry.batch),
              "encoder_hidden_states": normal(gen, shapes["encoder_hidden_states"])}
    if "text_embeds" in shapes:
        size = geometry.size
        values["text_embeds"] = normal(gen, shapes["text_embeds"])
        ids = [size.height, size.width, 0, 0, size.height, size.width]  # original size, crop, target size
        values["time_ids"] = np.tile(np.array(ids, dtype=np.float32), (geometry.batch, 1))
    return values


def added_cond_kwargs(inputs: Mapping[str, torch.Tensor]) -> dict | None:
    """SDXL's added conditions, left in float32 at every precision: diffusers concatenates text_embeds with
    its float32 time-id embedding and casts the result to the model's dtype. (Passing fp16 text_embeds makes
    that a mixed-dtype concat, which the dynamo exporter writes as an ill-typed ONNX Concat.)"""
    if "text_embeds" not in inputs:
        return None
    return {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}


class _UNetWrapper(ExportWrapper):
    def __init__(self, model, input_names: list[str], residual_count: int, compute_dtype=None):
        super().__init__(model, input_names, compute_dtype)
        self.residual_count = residual_count

    def compute(self, **inputs: torch.Tensor):
        down = mid = None
        if self.residual_count:
            down = [self.cast(inputs[down_residual_name(i)]) for i in range(self.residual_count)]
            mid = self.cast(inputs[MID_RESIDUAL])
        return self.model(
            self.cast(inputs["sample"]), self.cast(inputs["timestep"]), self.cast(inputs["encoder_hidden_states"]),
            added_cond_kwargs=added_cond_kwargs(inputs),
            down_block_additional_residuals=down, mid_block_additional_residual=mid, return_dict=False,
        )[0]


class UNet(ComponentDef):
    """UNet2DConditionModel -> `noise_pred` [B,4,h,w].

    Inputs: `sample`, `timestep` [B], `encoder_hidden_states` [B,77,C]; SDXL adds `text_embeds` [B,P] and
    `time_ids` [B,6]; with the spec option controlnet_residuals, `down_block_residual_0..N-1` and
    `mid_block_residual` (added to the skip connections, as diffusers' ControlNet pipelines do).
    """

    kind = "unet"

    def spatial_alignment(self, config: ModelConfig) -> int:
        return downsampling_alignment(config)

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        inputs = conditioning_inputs(config)
        if options.get("controlnet_residuals"):
            inputs += residual_decls(config)
        out_channels = int(config.get("out_channels", config["in_channels"]))
        return ComponentIO(inputs=inputs,
                           outputs=(TensorDecl("noise_pred", "float32", (BATCH, out_channels, HEIGHT, WIDTH)),))

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        io = self.io(config, options)
        residuals = len(residual_layout(config)) if options.get("controlnet_residuals") else 0
        return _UNetWrapper(module, io.input_names, residuals, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        io = self.io(config, options)
        gen = rng(seed, geometry)
        values = conditioning_values(config, io, geometry, gen, self)
        values_axes = self.axis_values(config, geometry)
        for decl in io.inputs:
            if decl.name not in values:  # the ControlNet residuals
                values[decl.name] = normal(gen, decl.shape(values_axes), 0.5)
        return values
