"""Images in and out of the API: PNG bytes carrying their request (image_files' chunks), and uploaded images
read into the entry's INIT_IMAGE and MASK (OpenAI's convention: transparent pixels are what to edit)."""

from __future__ import annotations

import io

import numpy as np

from ..image_files import A1111_KEY, JSON_KEY, ImageParameters
from .errors import bad_request

MAX_SIDE = 8192  # the client's own cap on an input image's side (triton/client_limits.py)
READABLE = ("PNG", "JPEG", "WEBP")


def encode_png(image: np.ndarray, parameters: ImageParameters | None = None) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes with the request in text chunks (as `generate` writes its files)."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    if parameters is not None:
        info.add_text(A1111_KEY, parameters.a1111_text())
        info.add_text(JSON_KEY, parameters.to_json())
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image, dtype=np.uint8)).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def _open(data: bytes, field: str):
    """The uploaded file as a PIL image, its pixels loaded; 400 naming the field when it is not one we read."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise bad_request(f"{field} is an empty file", field)
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in READABLE:
            raise bad_request(f"{field} is {image.format}; send a PNG (or JPEG, WebP)", field)
        if max(image.size) > MAX_SIDE:
            raise bad_request(f"{field} is {image.size[0]}x{image.size[1]}; sides up to {MAX_SIDE} pixels", field)
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError) as exc:
        raise bad_request(f"{field} is not a readable image ({exc})", field) from None
    return image


def _alpha(image) -> np.ndarray | None:
    """The alpha channel as uint8 [H, W], None for an image without one."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return np.asarray(image.convert("RGBA"))[..., 3]
    return None


def read_edit_inputs(image_data: bytes, mask_data: bytes | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(INIT_IMAGE uint8 [H, W, 3], MASK uint8 [H, W] or None) of an edit request. MASK = 255 - alpha: a
    transparent pixel (of the mask, else of the image itself) is white, repainted; an opaque image alone: None
    (img2img)."""
    image = _open(image_data, "image")
    rgb = np.ascontiguousarray(np.asarray(image.convert("RGB")), dtype=np.uint8)
    if mask_data is None:
        alpha = _alpha(image)
        return rgb, (None if alpha is None or alpha.min() == 255 else 255 - alpha)
    mask_image = _open(mask_data, "mask")
    if mask_image.size != image.size:
        raise bad_request(f"mask is {mask_image.size[0]}x{mask_image.size[1]}, the image "
                          f"{image.size[0]}x{image.size[1]}: they must be the same size", "mask")
    alpha = _alpha(mask_image)
    if alpha is None:
        raise bad_request("mask has no alpha channel: its transparent pixels mark what to edit (send an RGBA PNG)",
                          "mask")
    return rgb, np.ascontiguousarray(255 - alpha, dtype=np.uint8)
