"""Qwen-Image-Edit (diffusers' QwenImageEditPipeline): the reference image enters twice, as Qwen2.5-VL image tokens in
the prompt and as latent tokens beside the noise in the transformer.

What the pipeline does with the reference image, and where each step runs here:

- resized to about 1024² pixels at its own aspect (`calculate_dimensions`: sides multiples of 32) — on the host,
  `condition_size`;
- the prompt: the edit template with `<|vision_start|><|image_pad|><|vision_end|>` after the system part; the
  processor resizes the image again (`smart_resize`: multiples of 28, within min/max pixels), cuts it into 14×14
  patches (two temporal copies: 1176 values each) and repeats `<|image_pad|>` once per 2×2 merged patch — host;
- the vision tower (`model.visual`): patches -> one embedding per merged patch — the `image_encoder` engine
  (`QwenVisionEncoder`), its patch grid a shape of the input, so its windowed attention's cu_seqlens, window order
  and 2D rotary table are constants of each grid's graph;
- the language model: token embeddings with the image placeholders replaced by the image embeddings, 3D (mRoPE)
  position ids (`get_rope_index`: text positions count on, the image's run over its merged grid) — the ids on the
  host (`rope_positions`), the splice and the decoder stack in the `text_encoder` engine (`QwenEditTextEncoder`);
  `hidden_states[-1]` minus the template's first 64 positions (the image tokens are kept: they condition the
  transformer) — host;
- the VAE: the resized image's latent mean (`sample_mode="argmax"`: no draw), normalized per channel, packed —
  the `vae_encoder` engine at the reference image's size, then host;
- the transformer: noise tokens ‖ reference tokens, RoPE over both grids (`img_shapes` with two entries), output
  cut to the noise tokens — the `transformer` engine with build option `context_image` (`QwenImageTransformer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..families import QWEN_EDIT_TEMPLATE_TOKENS
from ..models.edit_reference import condition_size, fixed_context, image_processor_config, vision_grid
from .base import BATCH, ComponentDef, ComponentIO, ExportWrapper, Geometry, SymbolicDim, TensorDecl, normal, rng
from .model_config import ModelConfig

IMAGE_PAD = "<|image_pad|>"


def rope_positions(input_ids: np.ndarray, image_token_id: int, grid: tuple[int, int], merge: int) -> np.ndarray:
    """Qwen2.5-VL's 3D position ids [3, 1, L] for one unpadded prompt holding one image (`get_rope_index`): text
    tokens count on in all three rows; the image's tokens take (t, row, column) of its merged grid, offset by the
    position where the image starts; the text after it resumes past the image's largest index."""
    ids = input_ids.reshape(-1)
    image = np.flatnonzero(ids == image_token_id)
    rows, cols = grid[0] // merge, grid[1] // merge
    if len(image) != rows * cols or (len(image) and image[-1] - image[0] + 1 != len(image)):
        raise ValueError(f"the prompt holds {len(image)} image tokens, not one run of {rows}x{cols}")
    start = int(image[0])
    positions = np.zeros((3, len(ids)), dtype=np.int64)
    positions[:, :start] = np.arange(start)
    row, col = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions[0, start:start + rows * cols] = start
    positions[1, start:start + rows * cols] = start + row.reshape(-1)
    positions[2, start:start + rows * cols] = start + col.reshape(-1)
    after = len(ids) - (start + rows * cols)
    positions[:, start + rows * cols:] = start + max(rows, cols) + np.arange(after)
    return positions[:, None, :]


# --- the vision tower ---------------------------------------------------------------------------------

GRID_H = SymbolicDim("grid_h", "height")  # the reference image's patch grid (free on the reference runners only)
GRID_W = SymbolicDim("grid_w", "width")
IMAGE_TOKENS = SymbolicDim("image_tokens", "tokens")


class _VisionWrapper(ExportWrapper):
    def compute(self, patches):
        grid_h, grid_w, features = patches.shape
        grid_thw = torch.tensor([[1, grid_h, grid_w]], dtype=torch.int64)
        visual = self.model.model.visual
        return visual(self.cast(patches.reshape(grid_h * grid_w, features)), grid_thw=grid_thw).pooler_output


class QwenVisionEncoder(ComponentDef):
    """Qwen2.5-VL's vision tower (the text encoder folder's `model.visual`) -> `image_embeds` [N, D]: one embedding
    per 2×2 merged patch, N = grid_h·grid_w / 4, D the language model's width.

    Input `patches` [grid_h, grid_w, 1176]: the processor's `pixel_values` [grid_h·grid_w, 1176] viewed with its
    patch grid (the same memory: the grid is the `image_grid_thw` the tower needs, given by the shape as the
    Qwen-Image transformer's packed latents give theirs). Every dim is fixed by the build options: one graph per
    reference grid. Traced by the legacy (TorchScript) exporter: the tower splits its windows by Python lists of
    the grid's values, which torch.export takes as data-dependent; traced at a fixed grid they are constants.
    """

    kind = "qwen_vision_encoder"
    legacy_trace = True

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        vision = config["vision_config"]
        features = 3 * int(vision["temporal_patch_size"]) * int(vision["patch_size"]) ** 2
        width = int(vision["out_hidden_size"])
        context = fixed_context(options)
        grid, tokens = (GRID_H, GRID_W), IMAGE_TOKENS
        if context is not None:
            grid = vision_grid(context[0], context[1], _processor(config))
            tokens = context[2]
        return ComponentIO(inputs=(TensorDecl("patches", "float32", (*grid, features)),),
                           outputs=(TensorDecl("image_embeds", "float32", (tokens, width)),))

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _VisionWrapper(module, ["patches"], compute_dtype).eval()

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, tuple]:
        context = fixed_context(options)
        size = context[:2] if context else condition_size(geometry.size.width, geometry.size.height)
        features = self.io(config, options).inputs[0].dims[-1]
        return {"patches": (*vision_grid(*size, _processor(config)), features)}

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        return {"patches": normal(gen, self.shapes(config, options, geometry)["patches"])}


def _processor(config: ModelConfig) -> Mapping[str, Any]:
    return config["processor"]  # vision_config: the checkpoint's image processor settings beside the tower's


def vision_config(model_dir) -> dict[str, Any]:
    """The image_encoder's config: the text encoder's (its `vision_config` is the tower's), the image processor
    settings beside it as `processor`."""
    from pathlib import Path

    from .model_config import read_json

    return {**read_json(Path(model_dir) / "text_encoder" / "config.json"),
            "processor": image_processor_config(model_dir)}


# --- the language model over the prompt with the image's embeddings -------------------------------------

SEQUENCE = SymbolicDim("sequence", "text")
IMAGE_BLOCK = 2  # <|vision_start|> and <|vision_end|> around the image's tokens
DUMMY_IMAGE_TOKENS = 16  # a free reference's dummy image: a 4x4 merged grid


class _EditTextWrapper(ExportWrapper):
    def __init__(self, model, input_names, compute_dtype=None, image_token_id: int = 0):
        super().__init__(model, input_names, compute_dtype)
        self.image_token_id = image_token_id

    def compute(self, input_ids, attention_mask, position_ids, image_embeds):
        core = self.model.model
        embeds = core.get_input_embeddings()(input_ids)
        # masked_scatter written as a gather: the k-th placeholder takes the k-th image embedding (the same values)
        is_image = input_ids == self.image_token_id
        order = torch.clamp(torch.cumsum(is_image.to(torch.int64), dim=1) - 1, min=0)
        spliced = torch.where(is_image.unsqueeze(-1), image_embeds.to(embeds.dtype)[order], embeds)
        out = core.language_model(inputs_embeds=self.cast(spliced), attention_mask=attention_mask,
                                  position_ids=position_ids, output_hidden_states=True, return_dict=True)
        return out.hidden_states[-1]


class QwenEditTextEncoder(ComponentDef):
    """The edit prompt through Qwen2.5-VL's language model -> `hidden_states` [1, L, D].

    Inputs: `input_ids`, `attention_mask` [1, L] (the processor's: the template with the image placeholders
    repeated), `position_ids` [3, 1, L] (the 3D ids `rope_positions` computes), `image_embeds` [N, D] (the vision
    encoder's). Qwen2_5_VLModel.forward does the same: embeddings, the placeholders replaced, the decoder stack
    with those position ids. With the build options, N is fixed and L = 64 + 2 + N + the `text` axis (what follows
    the image block: the prompt and the template's 5-token tail), as for the text-to-image encoder after its 34.
    """

    kind = "qwen_edit_text_encoder"

    @property
    def resolution_dependent(self) -> bool:
        return False

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        width = int(config.language_config["hidden_size"])
        context = fixed_context(options)
        sequence, tokens = SEQUENCE, IMAGE_TOKENS
        if context is not None:
            tokens = context[2]
            sequence = SymbolicDim("sequence", "text", offset=QWEN_EDIT_TEMPLATE_TOKENS + IMAGE_BLOCK + tokens)
        return ComponentIO(
            inputs=(TensorDecl("input_ids", "int64", (BATCH, sequence)),
                    TensorDecl("attention_mask", "int64", (BATCH, sequence)),
                    TensorDecl("position_ids", "int64", (3, BATCH, sequence)),
                    TensorDecl("image_embeds", "float32", (tokens, width))),
            outputs=(TensorDecl("hidden_states", "float32", (BATCH, sequence, width)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _EditTextWrapper(module, self.io(config, options).input_names, compute_dtype,
                                image_token_id=int(config["image_token_id"])).eval()

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, tuple]:
        context = fixed_context(options)
        tokens = context[2] if context else DUMMY_IMAGE_TOKENS
        length = QWEN_EDIT_TEMPLATE_TOKENS + IMAGE_BLOCK + tokens + (geometry.text or 128)  # 128: the family's opt
        batch = geometry.batch
        return {"input_ids": (batch, length), "attention_mask": (batch, length), "position_ids": (3, batch, length),
                "image_embeds": (tokens, int(config.language_config["hidden_size"]))}

    def dummy_inputs(self, config, options, geometry, seed=0):
        """Random text ids around one run of image placeholders after the template's 64 positions, at the positions
        the reference grid gives them."""
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        batch, length = shapes["input_ids"]
        tokens = shapes["image_embeds"][0]
        placeholders = [int(config[k]) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                  "vision_end_token_id")]
        vocab = int((config.get("text_config") or config.component_config)["vocab_size"])
        ids = gen.integers(0, min(vocab, *placeholders), size=(batch, length), dtype=np.int64)
        start = QWEN_EDIT_TEMPLATE_TOKENS + 1
        ids[:, start:start + tokens] = int(config["image_token_id"])
        rows, cols = _merged_grid(config, options, tokens)
        positions = np.concatenate([rope_positions(row, int(config["image_token_id"]), (2 * rows, 2 * cols), 2)
                                    for row in ids], axis=1)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": positions,
                "image_embeds": normal(gen, shapes["image_embeds"])}


def _merged_grid(config: ModelConfig, options: Mapping[str, Any], tokens: int) -> tuple[int, int]:
    """The reference's merged grid (rows, columns) of `tokens` image tokens: the options' grid, else square."""
    context = fixed_context(options)
    if context is None or config.get("processor") is None:
        side = math.isqrt(tokens)
        return side, tokens // side
    grid_h, grid_w = vision_grid(context[0], context[1], config["processor"])
    merge = int(config["processor"]["merge_size"])
    return grid_h // merge, grid_w // merge


def edit_prompt_embeds(hidden_states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One unpadded prompt's states as QwenImageEditPipeline.encode_prompt returns them: the template's first 64
    positions dropped (the image's tokens stay), with an all-ones int64 mask."""
    embeds = hidden_states[:, QWEN_EDIT_TEMPLATE_TOKENS:]
    return embeds, np.ones(embeds.shape[:2], dtype=np.int64)
