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
from .base import BATCH, ComponentDef, ComponentIO, ExportWrapper, Geometry, SymbolicDim, TensorDecl, normal, rng
from .model_config import ModelConfig

CONDITION_AREA = 1024 * 1024  # the pixel area QwenImageEditPipeline resizes the reference image to
IMAGE_PAD = "<|image_pad|>"


def condition_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) QwenImageEditPipeline resizes a reference image of this aspect to (`calculate_dimensions`)."""
    ratio = width / height
    cond_width = math.sqrt(CONDITION_AREA * ratio)
    cond_height = cond_width / ratio
    return round(cond_width / 32) * 32, round(cond_height / 32) * 32


def vision_grid(width: int, height: int, processor_config: Mapping[str, Any]) -> tuple[int, int]:
    """(grid_h, grid_w) in 14×14 patches of an image of this size after the processor's `smart_resize`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch, merge = int(processor_config["patch_size"]), int(processor_config["merge_size"])
    pixels = _pixel_bounds(processor_config)
    resized_h, resized_w = smart_resize(height, width, factor=patch * merge, min_pixels=pixels[0],
                                        max_pixels=pixels[1])
    return resized_h // patch, resized_w // patch


def _pixel_bounds(processor_config: Mapping[str, Any]) -> tuple[int, int]:
    size = processor_config.get("size") or {}
    low = processor_config.get("min_pixels", size.get("shortest_edge"))
    high = processor_config.get("max_pixels", size.get("longest_edge"))
    return int(low), int(high)


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

GRID_H = SymbolicDim("grid_h", "height")  # the reference image's patch grid (shapes() gives the values)
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
    Qwen-Image transformer's packed latents give theirs). One grid per engine: the reference image of a bucket's
    aspect (`condition_size`, then the processor's resize).
    """

    kind = "qwen_vision_encoder"

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        vision = config["vision_config"]
        features = 3 * int(vision["temporal_patch_size"]) * int(vision["patch_size"]) ** 2
        width = int(vision["out_hidden_size"])
        return ComponentIO(inputs=(TensorDecl("patches", "float32", (GRID_H, GRID_W, features)),),
                           outputs=(TensorDecl("image_embeds", "float32", (IMAGE_TOKENS, width)),))

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _VisionWrapper(module, ["patches"], compute_dtype).eval()

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, tuple]:
        grid = vision_grid(*condition_size(geometry.size.width, geometry.size.height), _processor(config))
        features = self.io(config, options).inputs[0].dims[-1]
        return {"patches": (*grid, features)}

    def dummy_inputs(self, config, options, geometry, seed=0):
        gen = rng(seed, geometry)
        return {"patches": normal(gen, self.shapes(config, options, geometry)["patches"])}


def _processor(config: ModelConfig) -> Mapping[str, Any]:
    return config["processor"]  # vision_config: the checkpoint's image processor settings beside the tower's


def image_processor_config(model_dir) -> dict[str, Any]:
    """The checkpoint's image processor settings: `processor/processor_config.json`'s `image_processor` (what
    transformers 5 saves) or `processor/preprocessor_config.json` (released Qwen-Image-Edit folders)."""
    from pathlib import Path

    from ..errors import ModelError
    from .model_config import read_json

    folder = Path(model_dir) / "processor"
    combined, legacy = folder / "processor_config.json", folder / "preprocessor_config.json"
    if combined.is_file() and "image_processor" in read_json(combined):
        return dict(read_json(combined)["image_processor"])
    if legacy.is_file():
        return dict(read_json(legacy))
    raise ModelError(f"{folder} has no processor_config.json or preprocessor_config.json: an edit checkpoint's "
                     f"processor says how the reference image is cut into patches")


def vision_config(model_dir) -> dict[str, Any]:
    """The image_encoder's config: the text encoder's (its `vision_config` is the tower's), the image processor
    settings beside it as `processor`."""
    from pathlib import Path

    from .model_config import read_json

    return {**read_json(Path(model_dir) / "text_encoder" / "config.json"),
            "processor": image_processor_config(model_dir)}


def image_processor(model_dir):
    """The checkpoint's image processor, the PIL one (transformers' default one needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = image_processor_config(model_dir)
    settings.pop("image_processor_type", None)
    return Qwen2VLImageProcessorPil(**settings)


# --- the language model over the prompt with the image's embeddings -------------------------------------

SEQUENCE = SymbolicDim("sequence", "text")
IMAGE_TEXT_TOKENS = 16  # the dummy prompt's image: a 4x4 merged grid


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
    encoder's). Diffusers' own Qwen2_5_VLModel.forward does the same: embeddings, the placeholders replaced,
    the decoder stack with those position ids.
    """

    kind = "qwen_edit_text_encoder"

    @property
    def resolution_dependent(self) -> bool:
        return False

    def io(self, config: ModelConfig, options: Mapping[str, Any]) -> ComponentIO:
        width = int((config.get("text_config") or config.component_config)["hidden_size"])
        return ComponentIO(
            inputs=(TensorDecl("input_ids", "int64", (BATCH, SEQUENCE)),
                    TensorDecl("attention_mask", "int64", (BATCH, SEQUENCE)),
                    TensorDecl("position_ids", "int64", (3, BATCH, SEQUENCE)),
                    TensorDecl("image_embeds", "float32", (IMAGE_TOKENS, width))),
            outputs=(TensorDecl("hidden_states", "float32", (BATCH, SEQUENCE, width)),),
        )

    def wrapper(self, module, config: ModelConfig, options: Mapping[str, Any], compute_dtype=None):
        return _EditTextWrapper(module, self.io(config, options).input_names, compute_dtype,
                                image_token_id=int(config["image_token_id"])).eval()

    def shapes(self, config: ModelConfig, options: Mapping[str, Any], geometry: Geometry) -> dict[str, tuple]:
        length = geometry.text or 128
        width = self.io(config, options).inputs[-1].dims[-1]
        return {"input_ids": (1, length), "attention_mask": (1, length), "position_ids": (3, 1, length),
                "image_embeds": (IMAGE_TEXT_TOKENS, width)}

    def dummy_inputs(self, config, options, geometry, seed=0):
        """A prompt of random text ids with one run of image placeholders after the template's 64 positions."""
        gen = rng(seed, geometry)
        shapes = self.shapes(config, options, geometry)
        length, images = shapes["input_ids"][1], shapes["image_embeds"][0]
        vocab = int((config.get("text_config") or config.component_config)["vocab_size"])
        placeholders = [int(config[k]) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                  "vision_end_token_id")]
        ids = gen.integers(0, min(vocab, *placeholders), size=(1, length), dtype=np.int64)
        ids[0, QWEN_EDIT_TEMPLATE_TOKENS:QWEN_EDIT_TEMPLATE_TOKENS + images] = int(config["image_token_id"])
        side = int(math.isqrt(images))
        return {"input_ids": ids, "attention_mask": np.ones_like(ids),
                "position_ids": rope_positions(ids, int(config["image_token_id"]), (2 * side, 2 * side), 2),
                "image_embeds": normal(gen, shapes["image_embeds"])}


def edit_prompt_embeds(hidden_states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One unpadded prompt's states as QwenImageEditPipeline.encode_prompt returns them: the template's first 64
    positions dropped (the image's tokens stay), with an all-ones int64 mask."""
    embeds = hidden_states[:, QWEN_EDIT_TEMPLATE_TOKENS:]
    return embeds, np.ones(embeds.shape[:2], dtype=np.int64)
