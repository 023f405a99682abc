"""Qwen-Image-Edit's reference image, as a checkpoint folder and QwenImageEditPipeline size it: the resize to about
1024² at its aspect, the processor's patch grid, and the build options that fix both in an edit model's engines
(components/qwen_image_edit.py says what each engine does with them). Arithmetic on sizes and JSON; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ModelError

CONDITION_AREA = 1024 * 1024  # the pixel area QwenImageEditPipeline resizes the reference image to


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


# Build options of an edit model's components (engines_file/expand.py sets them per bucket): the reference image's
# resized size "WxH" (`condition_size` of the bucket's aspect) and its image token count in the prompt. They fix
# every reference-dependent dim of the graphs, so buckets of one aspect share their graphs and other aspects get
# their own. Without them (the torch reference runners), those dims are free.
CONTEXT_SIZE, CONTEXT_TOKENS = "context_size", "context_tokens"


def context_options(width: int, height: int, processor_config: Mapping[str, Any]) -> dict[str, str]:
    """The build options of an edit engine for a bucket of this size."""
    cond_width, cond_height = condition_size(width, height)
    grid_h, grid_w = vision_grid(cond_width, cond_height, processor_config)
    merge = int(processor_config["merge_size"])
    return {CONTEXT_SIZE: f"{cond_width}x{cond_height}", CONTEXT_TOKENS: str(grid_h * grid_w // merge ** 2)}


def fixed_context(options: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """(width, height, image tokens) the options fix, or None (a reference runner: any reference)."""
    size, tokens = options.get(CONTEXT_SIZE), options.get(CONTEXT_TOKENS)
    if not size or not tokens:
        return None
    width, height = (int(v) for v in str(size).split("x"))
    return width, height, int(tokens)


def image_processor_config(model_dir) -> dict[str, Any]:
    """The checkpoint's image processor settings: `processor/processor_config.json`'s `image_processor` (what
    transformers 5 saves) or `processor/preprocessor_config.json` (released Qwen-Image-Edit folders)."""
    folder = Path(model_dir) / "processor"
    combined, legacy = folder / "processor_config.json", folder / "preprocessor_config.json"
    if combined.is_file() and "image_processor" in _read(combined):
        return dict(_read(combined)["image_processor"])
    if legacy.is_file():
        return dict(_read(legacy))
    raise ModelError(f"{folder} has no processor_config.json or preprocessor_config.json: an edit checkpoint's "
                     f"processor says how the reference image is cut into patches")


def image_processor(model_dir):
    """The checkpoint's image processor, the PIL one (transformers' default one needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = image_processor_config(model_dir)
    settings.pop("image_processor_type", None)
    return Qwen2VLImageProcessorPil(**settings)


def _read(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from None
