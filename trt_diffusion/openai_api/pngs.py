"""Images in and out of the API: PNG bytes carrying their request (image_files' chunks), and uploaded images
read into the entry's INIT_IMAGE and MASK (OpenAI's convention: transparent pixels are what to edit)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

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
    """The uploaded file as a PIL image, its header read and no pixel decoded yet (Pillow opens lazily); 400
    naming the field when it is not one we read."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise bad_request(f"{field} is an empty file", field)
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:  # Pillow's words name the buffer's address: the same file, another message
        raise bad_request(f"{field} is not a readable image (no image format Pillow knows); send a PNG (or "
                          "JPEG, WebP)", field) from None
    except (OSError, Image.DecompressionBombError, ValueError) as exc:
        raise bad_request(f"{field} is not a readable image ({exc})", field) from None
    if image.format not in READABLE:
        raise bad_request(f"{field} is {image.format}; send a PNG (or JPEG, WebP)", field)
    if max(image.size) > MAX_SIDE:
        raise bad_request(f"{field} is {image.size[0]}x{image.size[1]}; sides up to {MAX_SIDE} pixels", field)
    return image


def _decode(image, field: str):
    """The pixels of an image `_open` read the header of: the costly part, run once its size is accepted."""
    from PIL import Image

    try:
        image.load()
    except (OSError, SyntaxError, Image.DecompressionBombError, ValueError) as exc:  # SyntaxError: Pillow's
        # parsers report a broken chunk met while decoding ("broken PNG file") as one
        raise bad_request(f"{field} is not a readable image ({exc})", field) from None
    return image


def _alpha(image) -> np.ndarray | None:
    """The alpha channel as uint8 [H, W], None for an image without one."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return np.asarray(image.convert("RGBA"))[..., 3]
    return None


def read_edit_inputs(image_data: bytes, mask_data: bytes | None, check_size: Callable[[int, int], object]
                     = lambda width, height: None) -> tuple[np.ndarray, np.ndarray | None]:
    """(INIT_IMAGE uint8 [H, W, 3], MASK uint8 [H, W] or None) of an edit request. MASK = 255 - alpha: a
    transparent pixel (of the mask, else of the image itself) is white, repainted; an opaque image alone: None
    (img2img).

    Both headers are read and `check_size(width, height)` (the served sizes: it raises to refuse) is called before
    any pixel is decoded: a small file that decodes to a huge image costs only its header. Blocking: the API runs
    it in a worker thread."""
    image = _open(image_data, "image")
    check_size(*image.size)
    mask_image = None if mask_data is None else _open(mask_data, "mask")
    if mask_image is not None and mask_image.size != image.size:
        raise bad_request(f"mask is {mask_image.size[0]}x{mask_image.size[1]}, the image "
                          f"{image.size[0]}x{image.size[1]}: they must be the same size", "mask")
    rgb = np.ascontiguousarray(np.asarray(_decode(image, "image").convert("RGB")), dtype=np.uint8)
    if mask_image is None:
        alpha = _alpha(image)
        return rgb, (None if alpha is None or alpha.min() == 255 else 255 - alpha)
    alpha = _alpha(_decode(mask_image, "mask"))
    if alpha is None:
        raise bad_request("mask has no alpha channel: its transparent pixels mark what to edit (send an RGBA PNG)",
                          "mask")
    return rgb, np.ascontiguousarray(255 - alpha, dtype=np.uint8)


class DecodeSlots:
    """Uploaded images decoded at once, at most `limit`, each in a worker thread (Pillow's decoding holds the GIL
    only in part and never the event loop). A request beyond the limit waits its turn rather than being refused:
    the decodes are bounded by the served sizes (checked from the header first), and the waiting requests by the
    server's connection limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.running = 0
        self.waiting = 0
        self._slots: Any = None  # an asyncio.Semaphore, made in the server's event loop

    def state(self) -> dict[str, int]:
        return {"running": self.running, "waiting": self.waiting, "limit": self.limit}

    async def run(self, function, *args):
        import asyncio

        slots = self._slots = self._slots or asyncio.Semaphore(self.limit)
        self.waiting += 1
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await asyncio.to_thread(function, *args)
        finally:
            self.running -= 1
            slots.release()
