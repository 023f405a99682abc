"""Z-Image (and Z-Image-Turbo): the Qwen3 text encoder and the single-stream DiT; the VAE is the generic
AutoencoderKL declaration (the host applies `latents / scaling_factor + shift_factor`, as for FLUX.1).

Text encoder: ZImagePipeline tokenizes the chat-templated prompt padded to max_sequence_length (512) and takes
`hidden_states[-2]`; the engine takes [B, 512] ids and mask and returns those states [B, 512, D]. The host keeps the
positions the mask keeps (`prompt_embeds`), one unpadded [L, D] per prompt, as the pipeline's list holds them.

Transformer: ZImageTransformer2DModel takes lists (one latent [C, 1, h, w] and one caption [L_i, D] per row) and
pads inside: each caption to its own multiple of 32 with a learned pad token (those pad tokens are attended), the
image tokens likewise, the image's rotary positions start after its own padded caption, and the rows' joint
sequences are padded to the longest with an attention mask. The engine takes the rows as tensors:
`encoder_hidden_states` [B, S, D] right-padded to the longest prompt with `encoder_hidden_states_mask` [B, S]
(1 for a prompt token), S on the `text` axis. The torch module behind the wrapper gets back exactly the lists
diffusers gives it (the reference is ZImagePipeline's computation, bit for bit); the traced graph is
`_tensor_forward`, the same computation written over padded tensors (the per-row lengths as masks and gathers,
the complex rotary embedding in real cos/sin), equal to diffusers' to float rounding (tests/z_image/).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from ..families import z_image as z_image_family
from .base import (
    BATCH,
    TEXT_AXIS,
    ComponentDef,
    ComponentIO,
    ExportWrapper,
    Geometry,
    SymbolicDim,
    TensorDecl,
    normal,
    rng,
)
from .flux2 import Flux2TextEncoder
from .model_config import ModelConfig

PATCH = 2  # ZImagePipeline's patch_size (and f_patch_size 1): 2×2 latent pixels per token
SEQ_MULTI_OF = 32  # the transformer pads each caption and each image to a multiple of this many tokens
TEXT = SymbolicDim("text_tokens", TEXT_AXIS)  # the batch's longest prompt, template included
LATENT_HEIGHT = SymbolicDim("latent_height", "height")
LATENT_WIDTH = SymbolicDim("latent_width", "width")


def z_image_text_lengths(options: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
    """(min, opt, max) prompt tokens: engines.yaml's text_length, else the family's declaration."""
    chosen = (options or {}).get("text_length")
    if chosen:
        low, opt, high = (int(v) for v in str(chosen).split(","))
        return low, opt, high
    return z_image_family.DECLARATION.text_lengths


class _HiddenStatesWrapper(ExportWrapper):
    def compute(self, input_ids, attention_mask):
        # the decoder stack: the released folders' Qwen3Model itself, or a Qwen3ForCausalLM's `model`
        decoder = getattr(self.model, "model", self.model)
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                      return_dict=True)
        return out.hidden_states[-2]


class ZImageTextEncoder(Flux2TextEncoder):
    """Qwen3Model (the decoder stack the released folders save) -> `prompt_embeds` [B, 512, D]: `hidden_states[-2]`
    over the padded sequence. FLUX.2's encoder declaration (ids and mask [B, 512], dummy inputs) with the one layer
    ZImagePipeline reads."""

    kind = "z_image_text_encoder"

    @property
    def layers(self) -> tuple[int, ...]:
        return (-2,)

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _HiddenStatesWrapper(module, self.io(config, options).input_names, compute_dtype).eval()


def prompt_tokens(tokenizer, prompt: str, length: int) -> tuple[np.ndarray, np.ndarray]:
    """ZImagePipeline._encode_prompt's ids and mask [1, length] for one prompt: a user turn, the generation prompt,
    `enable_thinking=True`, padded and truncated to max_sequence_length."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)
    tokens = tokenizer([text], padding="max_length", max_length=length, truncation=True, return_tensors="np")
    return (np.asarray(tokens["input_ids"], dtype=np.int64).reshape(1, -1),
            np.asarray(tokens["attention_mask"], dtype=np.int64).reshape(1, -1))


def prompt_embeds(states: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One prompt's states [L, D]: the positions its mask keeps (`prompt_embeds[i][prompt_masks[i]]`)."""
    return states[0][mask[0].astype(bool)]


def padded_rows(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row prompt states [L_i, D] as the engine's `encoder_hidden_states` [B, S, D] (zeros after each row's
    own) and `encoder_hidden_states_mask` [B, S] (int64), S the longest. Host-side selection and zeros only."""
    longest = max(len(row) for row in rows)
    embeds = np.zeros((len(rows), longest, rows[0].shape[-1]), dtype=np.float32)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, row in enumerate(rows):
        embeds[i, :len(row)], mask[i, :len(row)] = row, 1
    return embeds, mask


class _ZImageTransformerWrapper(ExportWrapper):
    def compute(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_mask):
        if _TRACING.active:
            return _tensor_forward(self.model, self.cast(hidden_states), self.cast(timestep),
                                   self.cast(encoder_hidden_states), encoder_hidden_states_mask)
        # the reference: the lists ZImagePipeline passes (latents [C, 1, h, w] views, captions [L_i, D])
        latents = list(self.cast(hidden_states).unsqueeze(2).unbind(dim=0))
        keep = encoder_hidden_states_mask.bool()
        captions = [row[kept] for row, kept in zip(self.cast(encoder_hidden_states), keep)]
        out = self.model(latents, self.cast(timestep), captions, return_dict=False)[0]
        return torch.stack([o.float() for o in out], dim=0).squeeze(2)


class ZImageTransformer(ComponentDef):
    """ZImageTransformer2DModel -> `noise_pred` [B, 16, h, w] (the model's output, before the pipeline negates it).

    Inputs: `hidden_states` [B, 16, h, w] (the latents; the graph patchifies 2×2), `timestep` [B] (`(1000 - t) /
    1000`, as ZImagePipeline passes it), `encoder_hidden_states` [B, S, D] and `encoder_hidden_states_mask` [B, S]
    (int64: each row's prompt tokens first, then zeros). With CFG the prompt's rows and the negative prompt's in one
    call, as the pipeline concatenates its two lists (the module docstring says how rows of different lengths run).
    """

    kind = "z_image_transformer"

    def export_context(self) -> contextlib.AbstractContextManager:
        return tensor_forward()

    def text_lengths(self, config: ModelConfig, options: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
        return z_image_text_lengths(options)

    def spatial_alignment(self, config: ModelConfig) -> int:
        return PATCH

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        if tuple(config.get("all_patch_size", (PATCH,))) != (PATCH,) or tuple(
                config.get("all_f_patch_size", (1,))) != (1,):
            raise ModelError(f"this Z-Image transformer has patch sizes {config.get('all_patch_size')} / "
                             f"{config.get('all_f_patch_size')}; ZImagePipeline runs patch 2, frame patch 1")
        if config.get("siglip_feat_dim") is not None:
            raise ModelError("this Z-Image transformer has SigLIP inputs (Z-Image-Omni): only the text-to-image "
                             "transformer is supported")
        channels = int(config.get("in_channels", 16))
        latent = (BATCH, channels, LATENT_HEIGHT, LATENT_WIDTH)
        return ComponentIO(
            inputs=(TensorDecl("hidden_states", "float32", latent),
                    TensorDecl("timestep", "float32", (BATCH,)),
                    TensorDecl("encoder_hidden_states", "float32", (BATCH, TEXT, int(config["cap_feat_dim"]))),
                    TensorDecl("encoder_hidden_states_mask", "int64", (BATCH, TEXT))),
            outputs=(TensorDecl("noise_pred", "float32", latent),),
        )

    def attention_score_bytes(self, config: ModelConfig, geometry: Geometry) -> int | None:
        axes = self.axis_values(config, geometry)
        image = _padded((axes["height"] // PATCH) * (axes["width"] // PATCH))
        tokens = image + _padded(axes[TEXT_AXIS])  # the joint sequence of the main layers
        return 4 * geometry.batch * int(config.get("n_heads", 30)) * tokens * tokens

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _ZImageTransformerWrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        batch, length = shapes["encoder_hidden_states_mask"]
        lengths = gen.integers(1, length + 1, size=batch)
        lengths[0] = length  # padded to the batch's longest prompt
        return {
            "hidden_states": normal(gen, shapes["hidden_states"]),
            "timestep": gen.uniform(0.0, 1.0, size=(batch,)).astype(np.float32),
            "encoder_hidden_states": normal(gen, shapes["encoder_hidden_states"]),
            "encoder_hidden_states_mask": (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64),
        }


class ZImageCalls:
    """The quantize stage's view of ZImagePipeline's transformer calls (the declaration's `quantize_calls`): the
    pipeline passes `(latents, timestep, captions)` positionally, the first and last as lists of per-row tensors."""

    @staticmethod
    def feeds(call) -> dict[str, torch.Tensor]:
        """The engine's inputs from one recorded call: the latents stacked [B, 16, h, w], the captions padded."""
        args, kwargs = call
        latents, timestep, captions = (list(args) + [kwargs.get(k) for k in ("x", "t", "cap_feats")][len(args):])[:3]
        embeds, mask = padded_rows([c.detach().float().numpy() for c in captions])
        return {"hidden_states": torch.stack(list(latents)).squeeze(2), "timestep": timestep,
                "encoder_hidden_states": torch.from_numpy(embeds), "encoder_hidden_states_mask": torch.from_numpy(mask)}

    @staticmethod
    def pipeline_output(output: torch.Tensor, call) -> torch.Tensor:
        """`noise_pred` [B, 16, h, w] as the per-row [16, 1, h, w] the pipeline indexes (a tensor serves its list)."""
        return output.unsqueeze(2)

    @staticmethod
    def trace_patches() -> contextlib.AbstractContextManager:
        return tensor_forward()


def _padded(tokens: int) -> int:
    return tokens + (-tokens) % SEQ_MULTI_OF


# --- the traced computation --------------------------------------------------------------------


class _Tracing:
    active = False


_TRACING = _Tracing()


@contextlib.contextmanager
def tensor_forward() -> Iterator[None]:
    """Inside: the wrapper runs `_tensor_forward` (what the graph is traced from) and the attention processor
    rotates in real cos/sin (diffusers' complex `view_as_complex` product exports with neither exporter). The
    reference outside runs diffusers' own forward. Restored on leaving."""
    from diffusers.models.transformers import transformer_z_image as z

    saved = z.ZSingleStreamAttnProcessor.__call__
    z.ZSingleStreamAttnProcessor.__call__ = _real_rotary_attention
    _TRACING.active = True
    try:
        yield
    finally:
        _TRACING.active = False
        z.ZSingleStreamAttnProcessor.__call__ = saved


def _real_rotary_attention(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                           freqs_cis=None):
    """ZSingleStreamAttnProcessor.__call__ with `freqs_cis` as (cos, sin) [B, S, d/2]: the complex product on
    interleaved pairs written out, (a + ib)(c + is) = (ac - bs) + i(as + bc)."""
    query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
    key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    if freqs_cis is not None:
        query, key = _rotate(query, freqs_cis), _rotate(key, freqs_cis)
    mask = None if attention_mask is None else attention_mask[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask)
    out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
    out = attn.to_out[0](out)
    return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _rotate(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = (f.unsqueeze(2) for f in freqs)  # [B, S, 1, d/2] over the heads
    real, imag = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(3).type_as(x)


def _rope_tables(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rotary embedder's per-axis tables (its own precompute: float64 angles, a complex64 polar) as (cos, sin)."""
    embedder = model.rope_embedder
    tables = embedder.precompute_freqs_cis(embedder.axes_dims, embedder.axes_lens, theta=embedder.theta)
    return [(t.real.contiguous(), t.imag.contiguous()) for t in tables]


def _rope(tables, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., d/2] of positions [..., 3]: each axis's table row, concatenated as RopeEmbedder does."""
    parts = [(cos[positions[..., i]], sin[positions[..., i]]) for i, (cos, sin) in enumerate(tables)]
    return torch.cat([p[0] for p in parts], dim=-1), torch.cat([p[1] for p in parts], dim=-1)


def _tensor_forward(model, latents, timestep, captions, caption_mask):
    """ZImageTransformer2DModel.forward (text-to-image mode) over padded tensors, for the trace.

    Per row i with L_i prompt tokens: its caption is padded to P_i = ceil(L_i / 32)·32 with `cap_pad_token`
    (positions (1 + k, 0, 0), attended), the image's N tokens to ceil(N / 32)·32 with `x_pad_token` (positions
    (0, 0, 0)), the image's positions are (P_i + 1, row, column). Across the batch the captions are padded to the
    longest P_i, masked: the context refiner and the main layers attend to the row's own P_i caption tokens only,
    as diffusers' attention mask says."""
    batch, channels, height, width = latents.shape
    rows, cols = height // PATCH, width // PATCH
    tokens = rows * cols
    image_len = tokens + (-tokens) % SEQ_MULTI_OF
    text = captions.shape[1]
    text_len = text + (-text) % SEQ_MULTI_OF
    device = latents.device
    tables = [(c.to(device), s.to(device)) for c, s in _rope_tables(model)]
    key = f"{PATCH}-1"

    adaln = model.t_embedder(timestep * model.t_scale).type_as(latents)

    # image tokens: "c (f pf) (h ph) (w pw) -> (f h w) (pf ph pw c)", embedded, the pad rows replaced
    patches = latents.reshape(batch, channels, rows, PATCH, cols, PATCH).permute(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(batch, tokens, PATCH * PATCH * channels)
    x = model.all_x_embedder[key](patches)
    x = torch.cat([x, model.x_pad_token.to(x.dtype).expand(batch, image_len - tokens, -1)], dim=1)

    lengths = caption_mask.sum(dim=1)  # L_i
    padded = (lengths + SEQ_MULTI_OF - 1) // SEQ_MULTI_OF * SEQ_MULTI_OF  # P_i
    grid = torch.arange(image_len, device=device)
    row_of = grid // cols
    col_of = grid - row_of * cols  # not `%`: ONNX's exporter has no remainder by a symbolic size
    image_pos = torch.stack([(padded + 1)[:, None].expand(batch, image_len),
                             row_of[None].expand(batch, image_len), col_of[None].expand(batch, image_len)], dim=-1)
    image_pos = torch.where((grid < tokens)[None, :, None], image_pos, torch.zeros_like(image_pos))
    x_freqs = _rope(tables, image_pos)
    for layer in model.noise_refiner:
        x = layer(x, None, x_freqs, adaln)

    # caption tokens: embedded, padded to the batch's P, the row's own pad positions given the pad token
    cap = model.cap_embedder(torch.nn.functional.pad(captions, (0, 0, 0, text_len - text)))
    places = torch.arange(text_len, device=device)
    is_token = places[None, :] < lengths[:, None]
    cap = torch.where(is_token[..., None], cap, model.cap_pad_token.to(cap.dtype))
    cap_pos = torch.stack([places + 1, torch.zeros_like(places), torch.zeros_like(places)], dim=-1)
    cap_freqs = _rope(tables, cap_pos[None].expand(batch, text_len, 3))
    in_row = places[None, :] < padded[:, None]  # the row's own P_i tokens (pad tokens included) are attended
    for layer in model.context_refiner:
        cap = layer(cap, in_row, cap_freqs)

    unified = torch.cat([x, cap], dim=1)
    freqs = tuple(torch.cat([a, b], dim=1) for a, b in zip(x_freqs, cap_freqs))
    mask = torch.cat([torch.ones(batch, image_len, dtype=torch.bool, device=device), in_row], dim=1)
    for layer in model.layers:
        unified = layer(unified, mask, freqs, adaln)
    out = model.all_final_layer[key](unified, c=adaln)[:, :tokens]
    # "(f h w) (pf ph pw c) -> c (f pf) (h ph) (w pw)"
    out = out.reshape(batch, rows, cols, PATCH, PATCH, model.out_channels).permute(0, 5, 1, 3, 2, 4)
    return out.reshape(batch, model.out_channels, height, width)
