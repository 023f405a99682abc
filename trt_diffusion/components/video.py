"""Wan 2.x video components: the UMT5 text encoder, the 3D transformer (both experts of Wan 2.2), the causal 3D
VAE decoder and, for image-to-video, the VAE encoder and Wan 2.1 I2V's CLIP vision encoder.

Video tensors are [B, C, frames, height, width]; the latent frame axis is `LATENT_FRAMES` ((F - 1) / 4 + 1 for
Wan's temporal factor 4), the decoder's pixel frames follow from it (4 × latent frames - 3).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from ..errors import ModelError
from ..families import Family, family_info
from .base import (
    BATCH,
    HEIGHT,
    LATENT_FRAMES,
    WIDTH,
    ComponentDef,
    ComponentIO,
    ExportWrapper,
    Geometry,
    SymbolicDim,
    TensorDecl,
    image_dims,
    normal,
    rng,
    timesteps,
)
from .model_config import ModelConfig


def pixel_frames(family: Family) -> SymbolicDim:
    """A causal video VAE's frames: the first latent frame gives one frame, each further one `factor`."""
    factor = family_info(family).temporal_factor
    return SymbolicDim("frames", "frames", Fraction(factor), offset=1 - factor)


class _UMT5Wrapper(ExportWrapper):
    def compute(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


class UMT5TextEncoder(ComponentDef):
    """UMT5EncoderModel -> `hidden_states` [B,S,D], S = WanPipeline's max_sequence_length default (512).

    `attention_mask` [B,S] is the tokenizer's (1 for the prompt's tokens, 0 for padding). The raw last hidden
    state leaves the graph: WanPipeline then zeroes every position past the prompt's length, which the runtime
    does on the host (a mask multiply, no data-dependent slicing in the graph).
    """

    kind = "umt5_text_encoder"

    @property
    def resolution_dependent(self) -> bool:
        return False

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        length, hidden = config.sequence_length, int(config["d_model"])
        return ComponentIO(
            inputs=(TensorDecl("input_ids", "int64", (BATCH, length)),
                    TensorDecl("attention_mask", "int64", (BATCH, length))),
            outputs=(TensorDecl("hidden_states", "float32", (BATCH, length, hidden)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _UMT5Wrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry: Geometry, seed=0):
        gen = rng(seed, geometry)
        length, vocab = config.sequence_length, int(config.get("vocab_size", 1000))
        ids = gen.integers(3, vocab, size=(geometry.batch, length), dtype=np.int64)
        lengths = gen.integers(2, length, size=geometry.batch)
        mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
        return {"input_ids": np.where(mask == 1, ids, 0), "attention_mask": mask}


class _WanTransformerWrapper(ExportWrapper):
    def compute(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
        image = None if encoder_hidden_states_image is None else self.cast(encoder_hidden_states_image)
        return self.model(hidden_states=self.cast(hidden_states), timestep=timestep,
                          encoder_hidden_states=self.cast(encoder_hidden_states),
                          encoder_hidden_states_image=image, return_dict=False)[0]


class WanTransformer(ComponentDef):
    """WanTransformer3DModel -> `noise_pred` [B,C,f,h,w] (a flow-matching velocity, like its input's shape).

    Inputs: `hidden_states` [B,C,f,h,w] latents, `timestep` [B] (the scheduler's timestep, 0..1000, as
    WanPipeline passes it), `encoder_hidden_states` [B,S,D] (UMT5 states, zero past each prompt's length).
    Wan 2.2's `transformer_2` (the low-noise expert) has the same declaration.

    Image-to-video checkpoints take 36 channels (WanImageToVideoPipeline concatenates the noise, the first-frame
    mask and the conditioning clip's latents); Wan 2.1 I2V's (config `image_dim`) also takes
    `encoder_hidden_states_image` [B,T,image_dim], the CLIP image encoder's output, T from the model folder's
    image_encoder (ModelConfig.image_tokens).
    """

    kind = "wan_transformer"

    def spatial_alignment(self, config: ModelConfig) -> int:
        return int(config.get("patch_size", (1, 2, 2))[-1])

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        channels = int(config["in_channels"])
        out_channels = int(config.get("out_channels", 16))
        inputs = (
            TensorDecl("hidden_states", "float32", (BATCH, channels, LATENT_FRAMES, HEIGHT, WIDTH)),
            TensorDecl("timestep", "float32", (BATCH,)),
            TensorDecl("encoder_hidden_states", "float32", (BATCH, config.sequence_length, int(config["text_dim"]))),
        )
        if config.get("image_dim") is not None:
            if not config.image_tokens:
                raise ModelError("this Wan transformer attends to image embeddings (image_dim in its config.json), "
                                 "but the model folder has no image_encoder/config.json to size them")
            inputs += (TensorDecl("encoder_hidden_states_image", "float32",
                                  (BATCH, config.image_tokens, int(config["image_dim"]))),)
        return ComponentIO(
            inputs=inputs,
            outputs=(TensorDecl("noise_pred", "float32", (BATCH, out_channels, LATENT_FRAMES, HEIGHT, WIDTH)),),
        )

    def attention_score_bytes(self, config: ModelConfig, geometry: Geometry) -> int | None:
        axes = self.axis_values(config, geometry)
        _, patch_h, patch_w = config.get("patch_size", (1, 2, 2))
        tokens = axes["frames"] * (axes["height"] // patch_h) * (axes["width"] // patch_w)
        return 4 * geometry.batch * int(config["num_attention_heads"]) * tokens * tokens

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _WanTransformerWrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        feeds = {"hidden_states": normal(gen, shapes["hidden_states"]), "timestep": timesteps(gen, geometry.batch),
                 "encoder_hidden_states": normal(gen, shapes["encoder_hidden_states"])}
        if "encoder_hidden_states_image" in shapes:
            feeds["encoder_hidden_states_image"] = normal(gen, shapes["encoder_hidden_states_image"])
        return feeds


class _WanDecoderWrapper(ExportWrapper):
    def compute(self, latent):
        return self.model.decode(self.cast(latent), return_dict=False)[0]


class WanVaeDecoder(ComponentDef):
    """AutoencoderKLWan.decode: `latent` [B,16,f,h,w] (unscaled: the pipeline has applied latents_std and
    latents_mean) -> `video` [B,3,F,H,W] in [-1, 1] (decode clamps), F = 4f - 3.

    The whole clip in one graph: decode runs its causal cache over the latent frames, which the exporter unrolls,
    so the latent frame count is fixed per engine (a bucket's frames), the way TensorRT's Wan demo builds it:
    engines_file.expand.fixed_frames makes one ONNX and engine per frame count, and the export writes that count
    into the graph's I/O instead of `latent_frames`/`frames`.
    """

    kind = "wan_vae_decoder"

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        image_height, image_width = image_dims(config.vae_scale_factor)
        return ComponentIO(
            inputs=(TensorDecl("latent", "float32", (BATCH, config.latent_channels, LATENT_FRAMES, HEIGHT, WIDTH)),),
            outputs=(TensorDecl("video", "float32",
                                (BATCH, int(config.get("out_channels", 3)), pixel_frames(self.family),
                                 image_height, image_width)),),
            image_outputs=("video",),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _WanDecoderWrapper(module, ["latent"], compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        return {"latent": normal(rng(seed, geometry), self.shapes(config, options, geometry)["latent"])}


class _WanEncoderWrapper(ExportWrapper):
    def compute(self, video):
        return self.model.encode(self.cast(video), return_dict=False)[0].mode()


class WanVaeEncoder(ComponentDef):
    """AutoencoderKLWan.encode: `video` [B,3,F,H,W] in [-1, 1] -> `latent` [B,16,f,h,w], the latent distribution's
    mode (WanImageToVideoPipeline's `retrieve_latents(..., sample_mode="argmax")`), before latents_mean/std.

    Image-to-video encodes the whole conditioning clip (the image, then F - 1 black frames), so like the decoder
    its causal cache is unrolled over the frames and the frame count is fixed per engine (expand.fixed_frames).
    """

    kind = "wan_vae_encoder"

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        image_height, image_width = image_dims(config.vae_scale_factor)
        return ComponentIO(
            inputs=(TensorDecl("video", "float32", (BATCH, 3, pixel_frames(self.family), image_height, image_width)),),
            outputs=(TensorDecl("latent", "float32", (BATCH, config.latent_channels, LATENT_FRAMES, HEIGHT, WIDTH)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _WanEncoderWrapper(module, ["video"], compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        shape = self.shapes(config, options, geometry)["video"]
        return {"video": rng(seed, geometry).uniform(-1.0, 1.0, size=shape).astype("float32")}


class _ClipVisionWrapper(ExportWrapper):
    def compute(self, pixel_values):
        return self.model(pixel_values=self.cast(pixel_values), output_hidden_states=True).hidden_states[-2]


class ClipImageEncoder(ComponentDef):
    """CLIPVisionModel -> `image_embeds` [B,T,D]: the penultimate layer's hidden states, as
    WanImageToVideoPipeline.encode_image takes them (`hidden_states[-2]`), T = (side / patch)^2 + 1.

    `pixel_values` [B,3,S,S] is the folder's CLIPImageProcessor output (resized, centre-cropped to the tower's
    side S, normalized), computed on the host by the runtime with that same processor.
    """

    kind = "clip_image_encoder"

    @property
    def resolution_dependent(self) -> bool:
        return False

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        side, hidden = int(config["image_size"]), int(config["hidden_size"])
        return ComponentIO(
            inputs=(TensorDecl("pixel_values", "float32", (BATCH, int(config.get("num_channels", 3)), side, side)),),
            outputs=(TensorDecl("image_embeds", "float32", (BATCH, clip_image_tokens(config), hidden)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _ClipVisionWrapper(module, ["pixel_values"], compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        return {"pixel_values": normal(rng(seed, geometry), self.shapes(config, options, geometry)["pixel_values"])}


def clip_image_tokens(vision_config: Mapping[str, Any]) -> int:
    """A CLIP vision tower's tokens: one per patch, plus the class token."""
    return (int(vision_config["image_size"]) // int(vision_config["patch_size"])) ** 2 + 1
