"""The VAE's two halves, exported separately: latents are unscaled on both sides of the graph
(the pipeline divides by scaling_factor and adds shift_factor before decoding, and the reverse after
encoding)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import BATCH, HEIGHT, WIDTH, ComponentDef, ComponentIO, ExportWrapper, TensorDecl, image_dims, normal, rng
from .model_config import ModelConfig


class _DecoderWrapper(ExportWrapper):
    def compute(self, latent):
        return self.model.decode(self.cast(latent), return_dict=False)[0]


class _EncoderWrapper(ExportWrapper):
    def compute(self, images):
        # mean and std, not a sample: diffusers' img2img/inpaint pipelines draw the sample from the request's
        # generator (mean + std * randn), which the runtime does on the host in the same order
        dist = self.model.encode(self.cast(images)).latent_dist
        return dist.mean, dist.std


class VaeDecoder(ComponentDef):
    """AutoencoderKL.decode: `latent` [B,C,h,w] -> `images` [B,3,H,W], the raw decoder output (about [-1, 1])."""

    kind = "vae_decoder"

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        image_height, image_width = image_dims(config.vae_scale_factor)
        return ComponentIO(
            inputs=(TensorDecl("latent", "float32", (BATCH, config.latent_channels, HEIGHT, WIDTH)),),
            outputs=(TensorDecl("images", "float32", (BATCH, int(config.get("out_channels", 3)), image_height, image_width)),),
            image_outputs=("images",),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _DecoderWrapper(module, ["latent"], compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        shapes = self.shapes(config, options, geometry)
        return {"latent": normal(rng(seed, geometry), shapes["latent"])}


class VaeEncoder(ComponentDef):
    """AutoencoderKL.encode: `images` [B,3,H,W] in [-1, 1] -> `latent` [B,C,h,w] (latent_dist.mean) and
    `latent_std` (latent_dist.std, from the clamped log-variance)."""

    kind = "vae_encoder"

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        image_height, image_width = image_dims(config.vae_scale_factor)
        return ComponentIO(
            inputs=(TensorDecl("images", "float32", (BATCH, int(config.get("in_channels", 3)), image_height, image_width)),),
            outputs=(TensorDecl("latent", "float32", (BATCH, config.latent_channels, HEIGHT, WIDTH)),
                     TensorDecl("latent_std", "float32", (BATCH, config.latent_channels, HEIGHT, WIDTH))),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _EncoderWrapper(module, ["images"], compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        shapes = self.shapes(config, options, geometry)
        values = rng(seed, geometry).uniform(-1.0, 1.0, size=shapes["images"]).astype("float32")
        return {"images": values}
