"""FLUX.2 (dev and Klein): a language-model text encoder whose hidden states at three layers are stacked, the
Flux2 transformer on 2×2-patchified latents, and the VAE (diffusers' own VaeDecoder declaration: the host applies
the batch-norm statistics and the unpatchify inside its graph).

The text length is fixed: Flux2Pipeline and Flux2KleinPipeline pad every prompt, after the chat template, to
max_sequence_length (512) and the transformer attends to all 512 positions, padding included (no mask), so the
encoder engine takes [B, 512] ids and mask and returns what `_get_mistral_3_small_prompt_embeds` /
`_get_qwen3_prompt_embeds` return: `hidden_states` at the family's layers — (10, 20, 30) for FLUX.2 dev, (9, 18, 27)
for Klein — stacked and laid out as [B, 512, 3·D]. The template and the tokenizer stay on the host
(runtime/flux2_loop.py).

The VAE decoder engine takes the latents as the transformer leaves them (normalized, 2×2-patchified: [B, 128,
h/2, w/2]) and applies what the pipelines do before `vae.decode` in its graph: `latents · sqrt(bn.running_var +
eps) + bn.running_mean`, then the unpatchify. The statistics are the VAE's own buffers, so they travel with its
weights (a served model's folder holds configs only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from ..families import FLUX2_TEXT_LAYERS, FLUX2_TEXT_LENGTH, Family, family_info
from .base import (
    BATCH,
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
from .transformers import FLUX_PACKING, IMAGE_TOKENS, float32_frequencies
from .vae import VaeDecoder

# The patchified latents' grid: 2×2 latent pixels per position
PATCH_ROWS = SymbolicDim("patch_rows", "height", Fraction(1, 2))
PATCH_COLS = SymbolicDim("patch_cols", "width", Fraction(1, 2))

ID_AXES = 4  # FLUX.2's position ids: (time, row, column, text position)


class _StackedStatesWrapper(ExportWrapper):
    def __init__(self, model, input_names, layers: tuple[int, ...], compute_dtype=None):
        super().__init__(model, input_names, compute_dtype)
        self.layers = layers

    def compute(self, input_ids, attention_mask):
        # the decoder stack alone (no LM head, no vision tower): Mistral3's language_model, Qwen3's model
        decoder = getattr(self.model.model, "language_model", self.model.model)
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                      return_dict=True)
        stacked = torch.stack([out.hidden_states[k] for k in self.layers], dim=1)  # [B, layers, L, D]
        batch, layers, length, hidden = stacked.shape
        return stacked.permute(0, 2, 1, 3).reshape(batch, length, layers * hidden)


class Flux2TextEncoder(ComponentDef):
    """Mistral3ForConditionalGeneration (FLUX.2 dev) or Qwen3ForCausalLM (Klein) -> `prompt_embeds` [B, 512, 3·D].

    Inputs `input_ids`, `attention_mask` [B, 512] (int64; the tokenizer's max_length padding). Output: the hidden
    states at the family's three layers, stacked as the pipelines stack them."""

    kind = "flux2_text_encoder"

    @property
    def resolution_dependent(self) -> bool:
        return False

    @property
    def layers(self) -> tuple[int, ...]:
        return FLUX2_TEXT_LAYERS[self.family]

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        text = config.language_config
        depth = int(text["num_hidden_layers"])
        if max(self.layers) > depth:
            raise ModelError(f"the {self.family.value} text encoder has {depth} layers; the pipeline stacks the hidden "
                             f"states of layers {list(self.layers)} (its text_encoder_out_layers default)")
        length, hidden = config.sequence_length, int(text["hidden_size"])
        return ComponentIO(
            inputs=(TensorDecl("input_ids", "int64", (BATCH, length)),
                    TensorDecl("attention_mask", "int64", (BATCH, length))),
            outputs=(TensorDecl("prompt_embeds", "float32", (BATCH, length, len(self.layers) * hidden)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _StackedStatesWrapper(module, self.io(config, options).input_names, self.layers, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry: Geometry, seed=0):
        gen = rng(seed, geometry)
        length = config.sequence_length
        high = int(config.language_config.get("vocab_size", 1000))
        if config.get("image_token_index") is not None:  # below Mistral3's image placeholder
            high = min(high, int(config["image_token_index"]))
        ids = gen.integers(0, high, size=(geometry.batch, length), dtype=np.int64)
        lengths = gen.integers(2, length + 1, size=geometry.batch)
        mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)  # right padding, as tokenized
        return {"input_ids": ids, "attention_mask": mask}


class _Flux2Wrapper(ExportWrapper):
    def compute(self, hidden_states, timestep, encoder_hidden_states, img_ids, txt_ids, guidance=None):
        return self.model(
            hidden_states=self.cast(hidden_states), timestep=self.cast(timestep),
            guidance=None if guidance is None else self.cast(guidance),
            encoder_hidden_states=self.cast(encoder_hidden_states), img_ids=img_ids, txt_ids=txt_ids,
            return_dict=False,
        )[0]


class Flux2Transformer(ComponentDef):
    """Flux2Transformer2DModel -> `noise_pred` [B, T, 128] (packed, like its input).

    Inputs: `hidden_states` [B, T, 128] (the 32-channel latents patchified 2×2 and packed, T = (h/2)·(w/2)),
    `timestep` [B] (t / 1000, as the pipelines pass it), `guidance` [B] (FLUX.2 dev's embedded guidance: the scale
    itself; Klein has none), `encoder_hidden_states` [B, 512, J] (the text encoder's stacked states),
    `img_ids` [T, 4] and `txt_ids` [512, 4] (int64 positions; the transformer reads the first row of batched ids)."""

    kind = "flux2_transformer"
    version = 2  # the quantized trace rotates by strided slices (quantize/trace_patches.py): its graph stays dynamic

    def export_context(self) -> contextlib.AbstractContextManager:
        from diffusers.models.transformers import transformer_flux2

        return float32_frequencies(transformer_flux2)  # Flux2PosEmbed's float64 frequencies

    def spatial_alignment(self, config: ModelConfig) -> int:
        return FLUX_PACKING

    def tokens(self, config: ModelConfig, latent_height: int, latent_width: int) -> int:
        return (latent_height // FLUX_PACKING) * (latent_width // FLUX_PACKING)

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        if int(config.get("patch_size", 1)) != 1:
            raise ModelError(f"the FLUX.2 transformer's patch_size is {config['patch_size']}; Flux2Pipeline "
                             f"patchifies the latents itself (patch_size 1)")
        channels = int(config.get("in_channels", 128))
        out_channels = int(config.get("out_channels") or channels)
        length = config.sequence_length
        inputs = [TensorDecl("hidden_states", "float32", (BATCH, IMAGE_TOKENS, channels)),
                  TensorDecl("timestep", "float32", (BATCH,))]
        if config.get("guidance_embeds", True):
            inputs.append(TensorDecl("guidance", "float32", (BATCH,)))
        inputs += [TensorDecl("encoder_hidden_states", "float32", (BATCH, length, int(config["joint_attention_dim"]))),
                   TensorDecl("img_ids", "int64", (IMAGE_TOKENS, ID_AXES)),
                   TensorDecl("txt_ids", "int64", (length, ID_AXES))]
        return ComponentIO(inputs=tuple(inputs),
                           outputs=(TensorDecl("noise_pred", "float32", (BATCH, IMAGE_TOKENS, out_channels)),))

    def attention_score_bytes(self, config: ModelConfig, geometry: Geometry) -> int | None:
        values = self.axis_values(config, geometry)
        tokens = values.get("tokens", 0) + config.sequence_length  # joint attention over text and image
        return 4 * geometry.batch * int(config.get("num_attention_heads", 48)) * tokens * tokens

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _Flux2Wrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        values = {
            "hidden_states": normal(gen, shapes["hidden_states"]),
            "timestep": timesteps(gen, geometry.batch, high=1.0),
            "guidance": gen.uniform(1.0, 5.0, size=(geometry.batch,)).astype(np.float32),
            "encoder_hidden_states": normal(gen, shapes["encoder_hidden_states"]),
            "img_ids": image_ids(*geometry.size.latent(config.vae_scale_factor)),
            "txt_ids": text_ids(config.sequence_length),
        }
        return {name: values[name] for name in shapes}


class _Flux2DecoderWrapper(ExportWrapper):
    def compute(self, latent):
        from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

        vae = self.model
        # as Flux2Pipeline.__call__ before vae.decode, in the VAE's dtype
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latent.device, latent.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latent.device,
                                                                                               latent.dtype)
        latents = Flux2Pipeline._unpatchify_latents(self.cast(latent) * std + mean)
        return vae.decode(latents, return_dict=False)[0]


class Flux2VaeDecoder(VaeDecoder):
    """AutoencoderKLFlux2 with the pipeline's latent denormalization: `latent` [B, 4·C, h/2, w/2] (the transformer's
    normalized, patchified latents on their grid) -> `images` [B, 3, H, W] in [-1, 1]."""

    kind = "flux2_vae_decoder"

    def spatial_alignment(self, config: ModelConfig) -> int:
        return FLUX_PACKING

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        image_height, image_width = image_dims(config.vae_scale_factor)
        channels = config.latent_channels * FLUX_PACKING * FLUX_PACKING
        return ComponentIO(
            inputs=(TensorDecl("latent", "float32", (BATCH, channels, PATCH_ROWS, PATCH_COLS)),),
            outputs=(TensorDecl("images", "float32", (BATCH, int(config.get("out_channels", 3)), image_height,
                                                      image_width)),),
            image_outputs=("images",),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _Flux2DecoderWrapper(module, ["latent"], compute_dtype).eval()


def image_ids(latent_height: int, latent_width: int) -> np.ndarray:
    """Flux2Pipeline._prepare_latent_ids for one image: (0, row, column, 0) per packed token, row-major."""
    rows, cols = np.meshgrid(np.arange(latent_height // FLUX_PACKING), np.arange(latent_width // FLUX_PACKING),
                             indexing="ij")
    zeros = np.zeros_like(rows)
    return np.stack([zeros, rows, cols, zeros], axis=-1).reshape(-1, ID_AXES).astype(np.int64)


def text_ids(length: int) -> np.ndarray:
    """Flux2Pipeline._prepare_text_ids: (0, 0, 0, position) per text token."""
    ids = np.zeros((length, ID_AXES), dtype=np.int64)
    ids[:, 3] = np.arange(length)
    return ids


def encoder_tokens(family: Family, tokenizer, prompt: str, text_max: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The declaration's `encoder_tokens`: the runtime's tokens (the engine's length is fixed, `text_max` unused)."""
    return prompt_tokens(family, tokenizer, prompt)


def prompt_tokens(family: Family, tokenizer, prompt: str) -> tuple[np.ndarray, np.ndarray]:
    """The encoder engine's `input_ids` and `attention_mask` [1, 512] for one prompt, tokenized as the family's
    pipeline tokenizes it (its chat template, padded and truncated to max_sequence_length)."""
    padding = dict(padding="max_length", truncation=True, max_length=FLUX2_TEXT_LENGTH)
    if family_info(family).system_message:  # FLUX.2 dev's Mistral: the pipeline's system message first
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        tokens = tokenizer.apply_chat_template(
            format_input(prompts=[prompt], system_message=SYSTEM_MESSAGE), add_generation_prompt=False,
            tokenize=True, return_dict=True, return_tensors="np", **padding)
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        tokens = tokenizer(text, return_tensors="np", **padding)
    return (np.asarray(tokens["input_ids"], dtype=np.int64).reshape(1, -1),
            np.asarray(tokens["attention_mask"], dtype=np.int64).reshape(1, -1))
