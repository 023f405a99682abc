"""Qwen-Image: the Qwen2.5-VL language-model text encoder, the MMDiT transformer and the Wan-style 3D VAE run on
one frame.

The text length is a profile dimension (the `text` axis: prompt tokens after the template's 34), for the encoder
and for the transformer that attends to its states: QwenImagePipeline pads a batch's prompts to the longest, not
to a fixed length. The range is engines.yaml's `text_length` (min/opt/max), by default diffusers': up to
max_sequence_length 512 tokens (families.py); the encoder's input is 34 longer (the template's system part).

What stays on the host (the runtime's part, as QwenImagePipeline._get_qwen_prompt_embeds does it):

- the template (`prompt_template_encode`) and the tokenizer, `max_length = 1024 + 34`, `padding=True` (right
  padding, the folder's tokenizer), truncated; ids and mask longer than the engine's 34 + 512 are cut there: the
  encoder is a causal language model, so the states of the positions kept do not depend on the ones cut;
- from `hidden_states` [B, L, D] (every position, padding included): per row, the positions whose mask is 1, the
  first 34 of them dropped; rows padded with zeros to the batch's longest, a 1/0 mask beside; then both cut to the
  request's max_sequence_length (the states past it are never used); an all-ones mask is passed as None by diffusers
  (the transformer's result is the same).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import replace
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from ..families import QWEN_MAX_TEXT_LENGTH, QWEN_TEMPLATE_TOKENS, QWEN_TEXT_LENGTH
from ..families import qwen_image as qwen_image_family
from ..models.edit_reference import fixed_context
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
    timesteps,
)
from .model_config import ModelConfig
from .qwen_image_edit import IMAGE_BLOCK
from .vae import VaeDecoder, VaeEncoder

TEXT = SymbolicDim("text_tokens", TEXT_AXIS)  # prompt tokens after the template's system part
SEQUENCE = SymbolicDim("sequence", TEXT_AXIS, offset=QWEN_TEMPLATE_TOKENS)  # what the encoder sees: 34 more
# Packed latents as rows × columns of 2×2 patches: the pipeline's [B, rows·cols, 64] tokens viewed as
# [B, rows, cols, 64] (the same memory), so the graph knows the grid its rotary embedding needs.
ROWS = SymbolicDim("patch_rows", "height", Fraction(1, 2))
COLS = SymbolicDim("patch_cols", "width", Fraction(1, 2))
# Qwen-Image-Edit's reference image: its own grid (about 1024² pixels at the bucket's aspect; shapes() says)
CONTEXT_ROWS = SymbolicDim("context_rows", "height")
CONTEXT_COLS = SymbolicDim("context_cols", "width")
PATCH = 2



def qwen_text_lengths(options: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
    """(min, opt, max) prompt tokens: engines.yaml's text_length (the spec's build option), else the family's
    (2, 128, 512: up to diffusers' max_sequence_length default)."""
    chosen = (options or {}).get("text_length")
    if chosen:
        low, opt, high = (int(v) for v in str(chosen).split(","))
        return low, opt, high
    return qwen_image_family.DECLARATION.text_lengths


class _QwenTextWrapper(ExportWrapper):
    def compute(self, input_ids, attention_mask):
        # the decoder stack without the LM head; `hidden_states[-1]` as QwenImagePipeline takes it
        out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                               return_dict=True)
        return out.hidden_states[-1]


class QwenTextEncoder(ComponentDef):
    """Qwen2_5_VLForConditionalGeneration's language model -> `hidden_states` [B, L, D]: `hidden_states[-1]` of the
    whole padded sequence, L = 34 + prompt tokens (the `text` axis: a profile dimension).

    Inputs `input_ids`, `attention_mask` [B, L] (int64; the tokenizer's 1 for tokens, 0 for right padding). The
    template drop and the mask-based split stay on the host (the module docstring says how).

    Build option `context_image` (Qwen-Image-Edit): the prompt holds the reference image's embeddings, and the
    declaration is `qwen_image_edit.QwenEditTextEncoder`'s (two more inputs).
    """

    kind = "qwen_text_encoder"

    @property
    def _edit(self):
        from .qwen_image_edit import QwenEditTextEncoder

        return QwenEditTextEncoder(self.family, self.component)

    @property
    def resolution_dependent(self) -> bool:
        return False

    def text_lengths(self, config: ModelConfig, options: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
        return qwen_text_lengths(options)

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        if _edit_options(options):
            return self._edit.io(config, options)
        width = int(config.language_config["hidden_size"])
        return ComponentIO(
            inputs=(TensorDecl("input_ids", "int64", (BATCH, SEQUENCE)),
                    TensorDecl("attention_mask", "int64", (BATCH, SEQUENCE))),
            outputs=(TensorDecl("hidden_states", "float32", (BATCH, SEQUENCE, width)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        if _edit_options(options):
            return self._edit.wrapper(module, config, options, compute_dtype)
        return _QwenTextWrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, tuple]:
        if _edit_options(options):
            return self._edit.shapes(config, options, self._with_text(config, options, geometry))
        return super().shapes(config, options, geometry)

    def _with_text(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> Geometry:
        """The geometry with its text length, the profile's opt where it says none (as axis_values does)."""
        return geometry if geometry.text else replace(geometry, text=self.text_lengths(config, options)[1])

    def dummy_inputs(self, config, options, geometry: Geometry, seed=0):
        if _edit_options(options):
            return self._edit.dummy_inputs(config, options, self._with_text(config, options, geometry), seed)
        gen = rng(seed, geometry)
        length = self.shapes(config, options, geometry)["input_ids"][1]
        # ids below the vision placeholders (image/video tokens would ask for pixel inputs)
        high = min(_text_vocab(config), *(int(config[k]) for k in _VISION_TOKENS if config.get(k) is not None))
        ids = gen.integers(0, high, size=(geometry.batch, length), dtype=np.int64)
        lengths = gen.integers(QWEN_TEMPLATE_TOKENS + 1, length + 1, size=geometry.batch)
        lengths[0] = length  # one row fills the sequence: the batch is padded to its longest
        mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
        return {"input_ids": np.where(mask == 1, ids, 0), "attention_mask": mask}


def _edit_options(options: Mapping[str, Any]) -> bool:
    """An edit model's build options (its reference fixed: context_size/context_tokens), or the reference runners'
    `context_image` (any reference)."""
    return bool(options.get("context_image")) or fixed_context(options) is not None


_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def prompt_embeds(hidden_states: np.ndarray, attention_mask: np.ndarray,
                  max_sequence_length: int = QWEN_TEXT_LENGTH) -> tuple[np.ndarray, np.ndarray]:
    """The encoder engine's output as QwenImagePipeline.encode_prompt returns it: per row the masked positions, the
    template's first 34 dropped, rows zero-padded to the longest, cut to `max_sequence_length`; with the 1/0 mask
    (int64) the transformer takes. Host-side arithmetic only (selection and zeros): the values are the engine's."""
    rows = [states[mask.astype(bool)][QWEN_TEMPLATE_TOKENS:] for states, mask in zip(hidden_states, attention_mask)]
    longest = max(len(row) for row in rows)
    embeds = np.zeros((len(rows), longest, hidden_states.shape[-1]), dtype=hidden_states.dtype)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, row in enumerate(rows):
        embeds[i, :len(row)], mask[i, :len(row)] = row, 1
    return embeds[:, :max_sequence_length], mask[:, :max_sequence_length]


def _text_vocab(config: ModelConfig) -> int:
    return int(config.language_config.get("vocab_size", 1000))


class _QwenTransformerWrapper(ExportWrapper):
    def compute(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_mask, image_latents=None):
        batch, rows, cols, channels = hidden_states.shape
        tokens, grids = hidden_states.reshape(batch, rows * cols, channels), [(1, rows, cols)]
        if image_latents is not None:  # Qwen-Image-Edit: the reference image's tokens after the noise's
            _, cond_rows, cond_cols, _ = image_latents.shape
            tokens = torch.cat([tokens, image_latents.reshape(batch, cond_rows * cond_cols, channels)], dim=1)
            grids.append((1, cond_rows, cond_cols))
        out = self.model(
            hidden_states=self.cast(tokens),
            timestep=self.cast(timestep), encoder_hidden_states=self.cast(encoder_hidden_states),
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            # every image of the batch has the grids (the rotary embedding reads the first entry only)
            img_shapes=[grids], return_dict=False,
        )[0]
        return out[:, :rows * cols].reshape(batch, rows, cols, -1)


class QwenImageTransformer(ComponentDef):
    """QwenImageTransformer2DModel -> `noise_pred` [B, h/2, w/2, 64] (packed, like its input).

    Inputs: `hidden_states` [B, h/2, w/2, C·4]: the pipeline's packed latents [B, (h/2)(w/2), C·4] viewed with their
    patch grid (a reshape, no copy: the rotary embedding needs the grid, which `img_shapes` gives diffusers and the
    shape gives the graph); `timestep` [B] (already divided by 1000, as QwenImagePipeline passes it);
    `encoder_hidden_states` [B, S, D] (the encoder's states after the host's drop and padding) and
    `encoder_hidden_states_mask` [B, S] (int64, 1 for a prompt token, 0 for padding: where diffusers passes None,
    all ones), S on the `text` axis. True CFG is two calls per step (prompt, negative prompt: each its own S).

    Build option `context_image` (Qwen-Image-Edit): a fifth input `image_latents` [B, h'/2, w'/2, 64], the
    reference image's packed latents at its own size (`qwen_image_edit.condition_size` of the bucket's aspect),
    joined after the noise tokens with RoPE over both grids; `noise_pred` keeps the noise tokens.
    """

    kind = "qwen_image_transformer"
    version = 2  # the rotation by strided slices (a legacy trace kept the text length dynamic)

    def export_context(self) -> contextlib.AbstractContextManager:
        return real_rotary_embeddings()

    def text_lengths(self, config: ModelConfig, options: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
        return qwen_text_lengths(options)

    def spatial_alignment(self, config: ModelConfig) -> int:
        return int(config.get("patch_size", PATCH))

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        for unsupported in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds"):
            if config.get(unsupported):
                raise ModelError(f"this Qwen-Image transformer sets {unsupported} in its config.json (an edit, "
                                 f"layered or guidance-distilled variant): only Qwen-Image's text-to-image "
                                 f"transformer is supported")
        if int(config.get("patch_size", PATCH)) != PATCH:
            raise ModelError(f"the Qwen-Image transformer's patch_size is {config['patch_size']}; QwenImagePipeline "
                             f"packs 2x2 latent patches")
        channels = int(config.get("in_channels", 64))
        out_channels = PATCH * PATCH * int(config.get("out_channels", 16))
        text, context_dims = TEXT, (CONTEXT_ROWS, CONTEXT_COLS)
        context = fixed_context(options)
        if context is not None:  # an edit engine: the reference's grid, and its image block ahead of the prompt
            factor = config.vae_scale_factor * PATCH
            context_dims = (context[1] // factor, context[0] // factor)
            text = SymbolicDim("text_tokens", TEXT_AXIS, offset=IMAGE_BLOCK + context[2])
        edit = _edit_options(options)
        return ComponentIO(
            inputs=(
                TensorDecl("hidden_states", "float32", (BATCH, ROWS, COLS, channels)),
                TensorDecl("timestep", "float32", (BATCH,)),
                TensorDecl("encoder_hidden_states", "float32", (BATCH, text, int(config["joint_attention_dim"]))),
                TensorDecl("encoder_hidden_states_mask", "int64", (BATCH, text)),
            ) + ((TensorDecl("image_latents", "float32", (BATCH, *context_dims, channels)),) if edit else ()),
            outputs=(TensorDecl("noise_pred", "float32", (BATCH, ROWS, COLS, out_channels)),),
        )

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, tuple]:
        shapes = super().shapes(config, options, geometry)
        if "image_latents" in shapes and fixed_context(options) is None:  # the reference's grid: the bucket aspect's
            from ..models.edit_reference import condition_size

            width, height = condition_size(geometry.size.width, geometry.size.height)
            factor = config.vae_scale_factor * PATCH
            shapes["image_latents"] = (geometry.batch, height // factor, width // factor, shapes["image_latents"][-1])
        return shapes

    def attention_score_bytes(self, config: ModelConfig, geometry: Geometry) -> int | None:
        axes = self.axis_values(config, geometry)
        tokens = (axes["height"] // PATCH) * (axes["width"] // PATCH) + axes[TEXT_AXIS]  # joint attention
        return 4 * geometry.batch * int(config.get("num_attention_heads", 24)) * tokens * tokens

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _QwenTransformerWrapper(module, self.io(config, options).input_names, compute_dtype).eval()

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        batch, length = shapes["encoder_hidden_states_mask"]
        lengths = gen.integers(1, length + 1, size=batch)
        lengths[0] = length  # padded to the batch's longest prompt
        inputs = {
            "hidden_states": normal(gen, shapes["hidden_states"]),
            "timestep": timesteps(gen, geometry.batch, high=1.0),
            "encoder_hidden_states": normal(gen, shapes["encoder_hidden_states"]),
            "encoder_hidden_states_mask": (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64),
        }
        if "image_latents" in shapes:
            inputs["image_latents"] = normal(gen, shapes["image_latents"])
        return inputs


class _QwenDecoderWrapper(ExportWrapper):
    def compute(self, latent):
        # one frame: QwenImagePipeline decodes [B, 16, 1, h, w] and keeps frame 0
        return self.model.decode(self.cast(latent).unsqueeze(2), return_dict=False)[0][:, :, 0]


class QwenVaeDecoder(VaeDecoder):
    """AutoencoderKLQwenImage.decode on one frame: `latent` [B, 16, h, w] -> `images` [B, 3, H, W] in [-1, 1].

    The latent is unscaled (the host has applied `latents / (1 / latents_std) + latents_mean` to the unpacked
    latents) and has no frame axis: the graph adds it and takes frame 0 of the decoded clip, as the pipeline does.
    """

    kind = "qwen_vae_decoder"

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _QwenDecoderWrapper(module, ["latent"], compute_dtype).eval()


class _QwenEncoderWrapper(ExportWrapper):
    def compute(self, images):
        dist = self.model.encode(self.cast(images).unsqueeze(2)).latent_dist
        return dist.mean[:, :, 0], dist.std[:, :, 0]


class QwenVaeEncoder(VaeEncoder):
    """AutoencoderKLQwenImage.encode on one frame: `images` [B, 3, H, W] in [-1, 1] -> `latent` (latent_dist.mean)
    and `latent_std` [B, 16, h, w], before latents_mean/std.

    Mean and std, not a sample: QwenImageImg2ImgPipeline draws `mean + std * randn` from the request's generator
    (retrieve_latents' "sample" mode, the noise shaped [B, 16, 1, h, w]), which the runtime does on the host.
    """

    kind = "qwen_vae_encoder"

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        io = super().io(config, options)
        context = fixed_context(options)
        if context is None:
            return io
        # an edit engine encodes the reference image at its resized size, whatever the bucket's
        width, height, _ = context
        latent = (BATCH, config.latent_channels, height // config.vae_scale_factor, width // config.vae_scale_factor)
        images = io.inputs[0]
        return ComponentIO(inputs=(TensorDecl(images.name, images.dtype, (*images.dims[:2], height, width)),),
                           outputs=tuple(TensorDecl(t.name, t.dtype, latent) for t in io.outputs))

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _QwenEncoderWrapper(module, ["images"], compute_dtype).eval()


# --- the rotary embedding in real arithmetic ---------------------------------------------------


@contextlib.contextmanager
def real_rotary_embeddings() -> Iterator[None]:
    """Inside: Qwen-Image's rotary embedding is computed in real cos/sin, and the text length stays symbolic.

    diffusers keeps the frequencies as complex tensors (`torch.polar`) and rotates with complex products
    (`view_as_complex`), which neither ONNX exporter supports. Here `QwenEmbedRope.forward` returns (cos, sin)
    pairs — the real and imaginary parts of the same tables, sliced the same way — and `apply_rotary_emb_qwen`
    rotates interleaved pairs with them: (a + ib)(c + is) written out, the output identical
    (tests/models/test_tiny_qwen.py). The complex path's lru_cache is not called (a cached complex table would be
    stale inside a trace), and the two places that make the text length a Python int (`int(max_txt_seq_len)`,
    `torch.as_tensor(text_seq_len)` in compute_text_seq_len_from_mask, whose per-sample lengths forward drops) are
    replaced, so the traced graph keeps S dynamic. Restored on leaving.
    """
    from diffusers.models.transformers import transformer_qwenimage as qwen

    saved = (qwen.QwenEmbedRope.forward, qwen.apply_rotary_emb_qwen, qwen.compute_text_seq_len_from_mask)
    qwen.QwenEmbedRope.forward = _real_rope_forward
    qwen.apply_rotary_emb_qwen = _rotate_real
    qwen.compute_text_seq_len_from_mask = _text_length_and_mask
    try:
        yield
    finally:
        qwen.QwenEmbedRope.forward, qwen.apply_rotary_emb_qwen, qwen.compute_text_seq_len_from_mask = saved


def _real_rope_forward(self, video_fhw, device=None, max_txt_seq_len=None):
    """QwenEmbedRope.forward's slicing, on the (cos, sin) of its tables: ((img cos, img sin), (txt cos, txt sin))."""
    if max_txt_seq_len is None:
        raise ValueError("`max_txt_seq_len` must be provided.")
    if isinstance(video_fhw, list):
        video_fhw = video_fhw[0]
    if not isinstance(video_fhw, list):
        video_fhw = [video_fhw]
    pos = (self.pos_freqs.real.to(device), self.pos_freqs.imag.to(device))
    neg = (self.neg_freqs.real.to(device), self.neg_freqs.imag.to(device))
    image, max_index = [], 0
    for idx, (frame, height, width) in enumerate(video_fhw):
        image.append(tuple(_video_table(self, p, n, frame, height, width, idx) for p, n in zip(pos, neg)))
        max_index = max(height // 2, width // 2, max_index) if self.scale_rope else max(height, width, max_index)
    image_cos, image_sin = (torch.cat([part[i] for part in image], dim=0) for i in (0, 1))
    text = tuple(table[max_index:max_index + max_txt_seq_len, ...] for table in pos)
    return (image_cos, image_sin), text


def _video_table(self, pos_table, neg_table, frame, height, width, idx):
    """QwenEmbedRope._compute_video_freqs on one real table (the cos or the sin part)."""
    # the axes' columns by slicing, not split(): a folded SplitToSequence is a list graphsurgeon cannot store
    first, second = self.axes_dim[0] // 2, self.axes_dim[0] // 2 + self.axes_dim[1] // 2
    freqs_pos, freqs_neg = ((t[:, :first], t[:, first:second], t[:, second:]) for t in (pos_table, neg_table))
    freqs_frame = freqs_pos[0][idx:idx + frame].view(frame, 1, 1, -1).expand(frame, height, width, -1)
    if self.scale_rope:
        freqs_height = torch.cat([freqs_neg[1][-(height - height // 2):], freqs_pos[1][:height // 2]], dim=0)
        freqs_width = torch.cat([freqs_neg[2][-(width - width // 2):], freqs_pos[2][:width // 2]], dim=0)
    else:
        freqs_height, freqs_width = freqs_pos[1][:height], freqs_pos[2][:width]
    freqs_height = freqs_height.view(1, height, 1, -1).expand(frame, height, width, -1)
    freqs_width = freqs_width.view(1, 1, width, -1).expand(frame, height, width, -1)
    return torch.cat([freqs_frame, freqs_height, freqs_width], dim=-1).reshape(frame * height * width, -1)


def _rotate_real(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
    """apply_rotary_emb_qwen(use_real=False)'s complex product on interleaved pairs, in reals: x [B, S, H, D],
    freqs_cis (cos, sin) [S, D/2]."""
    cos, sin = (f.unsqueeze(1) for f in freqs_cis)
    # the pairs by strided slices, not a reshape over x.shape: the legacy (quantized) trace bakes that shape's
    # text length into the graph (the same values either way)
    real, imag = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(3).type_as(x)


def _text_length_and_mask(encoder_hidden_states, encoder_hidden_states_mask):
    """compute_text_seq_len_from_mask's two values forward uses (S, the boolean mask), S kept symbolic."""
    mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(torch.bool)
    return encoder_hidden_states.shape[1], None, mask


# diffusers' QwenImagePipeline.prompt_template_encode (its system part tokenizes to the 34 positions dropped)
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")


def encoder_tokens(family, tokenizer, prompt: str, text_max: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The declaration's `encoder_tokens`: the runtime's tokens, cut at the entry's (or the family's) text max."""
    return prompt_tokens(tokenizer, prompt, text_max)


def prompt_tokens(tokenizer, prompt: str, text_max: int) -> tuple[np.ndarray, np.ndarray]:
    """The encoder engine's `input_ids` and `attention_mask` [1, L] for one prompt: QwenImagePipeline's template and
    tokenization, cut to the engine's longest sequence (its template's 34 positions + `text_max` prompt tokens)."""
    tokens = tokenizer([PROMPT_TEMPLATE.format(prompt)], max_length=QWEN_MAX_TEXT_LENGTH + QWEN_TEMPLATE_TOKENS,
                       padding=True, truncation=True, return_tensors="np")
    keep = QWEN_TEMPLATE_TOKENS + text_max
    return tokens.input_ids.astype(np.int64)[:, :keep], tokens.attention_mask.astype(np.int64)[:, :keep]
