"""SD3 and FLUX diffusion transformers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
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

IMAGE_TOKENS = SymbolicDim("image_tokens", "tokens")
FLUX_PACKING = 2  # FluxPipeline packs 2x2 latent pixels into one token


class _SD3Wrapper(ExportWrapper):
    def compute(self, hidden_states, timestep, encoder_hidden_states, pooled_projections):
        return self.model(
            hidden_states=self.cast(hidden_states), timestep=self.cast(timestep),
            encoder_hidden_states=self.cast(encoder_hidden_states),
            pooled_projections=self.cast(pooled_projections), return_dict=False,
        )[0]


class SD3Transformer(ComponentDef):
    """SD3Transformer2DModel -> `noise_pred` [B,C,h,w].

    Inputs: `hidden_states` [B,C,h,w] latents, `timestep` [B] (0..1000, as StableDiffusion3Pipeline passes it),
    `encoder_hidden_states` [B,S,J] (CLIP-L/G then T5 tokens), `pooled_projections` [B,P].
    """

    kind = "sd3_transformer"

    def spatial_alignment(self, config: ModelConfig) -> int:
        return int(config.get("patch_size", 2))

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        channels = int(config["in_channels"])
        out_channels = int(config.get("out_channels", channels))
        return ComponentIO(
            inputs=(
                TensorDecl("hidden_states", "float32", (BATCH, channels, HEIGHT, WIDTH)),
                TensorDecl("timestep", "float32", (BATCH,)),
                TensorDecl("encoder_hidden_states", "float32",
                           (BATCH, config.sequence_length, int(config["joint_attention_dim"]))),
                TensorDecl("pooled_projections", "float32", (BATCH, int(config["pooled_projection_dim"]))),
            ),
            outputs=(TensorDecl("noise_pred", "float32", (BATCH, out_channels, HEIGHT, WIDTH)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _SD3Wrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        return {"hidden_states": normal(gen, shapes["hidden_states"]), "timestep": timesteps(gen, geometry.batch),
                "encoder_hidden_states": normal(gen, shapes["encoder_hidden_states"]),
                "pooled_projections": normal(gen, shapes["pooled_projections"])}


@contextlib.contextmanager
def float32_frequencies(diffusers_module) -> Iterator[None]:
    """Inside: a diffusers transformer module's `maybe_adjust_dtype_for_device` answers float32, so its rotary
    frequencies (float64 in diffusers, which TensorRT cannot run) are traced in float32; positions are small
    integers, and the export check and parity show the difference is at float32 rounding. Restored on leaving."""
    original = diffusers_module.maybe_adjust_dtype_for_device
    diffusers_module.maybe_adjust_dtype_for_device = lambda dtype, device: torch.float32
    try:
        yield
    finally:
        diffusers_module.maybe_adjust_dtype_for_device = original


def float32_rotary_embeddings() -> contextlib.AbstractContextManager:
    """FluxPosEmbed's frequencies in float32 while tracing (float32_frequencies)."""
    from diffusers.models.transformers import transformer_flux

    return float32_frequencies(transformer_flux)


class _FluxWrapper(ExportWrapper):
    def compute(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids, txt_ids,
                guidance=None):
        return self.model(
            hidden_states=self.cast(hidden_states), timestep=self.cast(timestep),
            guidance=None if guidance is None else self.cast(guidance),
            encoder_hidden_states=self.cast(encoder_hidden_states),
            pooled_projections=self.cast(pooled_projections),
            img_ids=self.cast(img_ids), txt_ids=self.cast(txt_ids), return_dict=False,
        )[0]


class FluxTransformer(ComponentDef):
    """FluxTransformer2DModel -> `noise_pred` [B,T,C·4] (packed, like its input).

    Inputs: `hidden_states` [B,T,C·4] packed latents (T = (h/2)·(w/2)), `timestep` [B] (already divided
    by 1000, as FluxPipeline passes it), `guidance` [B] (guidance-distilled models only: the guidance
    scale itself), `encoder_hidden_states` [B,S,J] (T5), `pooled_projections` [B,P] (CLIP), `img_ids` [T,3],
    `txt_ids` [S,3].

    Build option `context_image` (an edit model, FLUX.1 Kontext): the init image's packed latents follow the
    noise tokens in `hidden_states` and `img_ids` (ids with a first coordinate of 1), so the token axis is twice
    the bucket's; the pipeline keeps the first T tokens of `noise_pred`.
    """

    kind = "flux_transformer"
    version = 2  # float32 rotary embeddings in the graph

    def export_context(self) -> contextlib.AbstractContextManager:
        return float32_rotary_embeddings()

    def spatial_alignment(self, config: ModelConfig) -> int:
        return FLUX_PACKING

    def tokens(self, config: ModelConfig, latent_height: int, latent_width: int) -> int:
        return (latent_height // FLUX_PACKING) * (latent_width // FLUX_PACKING)

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, tuple]:
        values = self.axis_values(config, geometry)
        if options.get("context_image") and "tokens" in values:
            values["tokens"] *= 2  # the context image's tokens beside the noise tokens (same size: never resized)
        return {t.name: t.shape(values) for t in self.io(config, options).inputs}

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        channels = int(config["in_channels"])
        out_channels = int(config.get("out_channels", channels))
        length = config.sequence_length
        inputs = [
            TensorDecl("hidden_states", "float32", (BATCH, IMAGE_TOKENS, channels)),
            TensorDecl("timestep", "float32", (BATCH,)),
        ]
        if config.get("guidance_embeds", False):
            inputs.append(TensorDecl("guidance", "float32", (BATCH,)))
        inputs += [
            TensorDecl("encoder_hidden_states", "float32", (BATCH, length, int(config["joint_attention_dim"]))),
            TensorDecl("pooled_projections", "float32", (BATCH, int(config["pooled_projection_dim"]))),
            TensorDecl("img_ids", "float32", (IMAGE_TOKENS, 3)),
            TensorDecl("txt_ids", "float32", (length, 3)),
        ]
        return ComponentIO(inputs=tuple(inputs),
                           outputs=(TensorDecl("noise_pred", "float32", (BATCH, IMAGE_TOKENS, out_channels)),))

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _FluxWrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        height, width = geometry.size.latent(config.vae_scale_factor)
        rows, cols = np.meshgrid(np.arange(height // FLUX_PACKING), np.arange(width // FLUX_PACKING), indexing="ij")
        img_ids = np.stack([np.zeros_like(rows), rows, cols], axis=-1).reshape(-1, 3).astype(np.float32)
        if options.get("context_image"):
            context_ids = img_ids.copy()
            context_ids[:, 0] = 1.0
            img_ids = np.concatenate([img_ids, context_ids])
        values = {
            "hidden_states": normal(gen, shapes["hidden_states"]),
            "timestep": timesteps(gen, geometry.batch, high=1.0),
            "guidance": gen.uniform(1.0, 5.0, size=(geometry.batch,)).astype(np.float32),
            "encoder_hidden_states": normal(gen, shapes["encoder_hidden_states"]),
            "pooled_projections": normal(gen, shapes["pooled_projections"]),
            "img_ids": img_ids,
            "txt_ids": np.zeros(shapes["txt_ids"], dtype=np.float32),
        }
        return {name: values[name] for name in shapes}
