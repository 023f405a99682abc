"""Cheap previews of the latents while a request denoises: a per-family linear map from latent channels to RGB
(the approximation the popular UIs use for their live previews), no VAE call. A preview is the size of the
latents (1/8 of the image: 64x64 for a 512x512 request).
"""

from __future__ import annotations

import numpy as np

from ...families import family_info


def latent_rgb_map(family: str, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights [C, 3], bias [3]): the family's fitted map (its declaration's `latent_rgb`: latent channel ->
    (R, G, B) contribution, then a bias, fitted on decoded images as in ComfyUI's latent_formats) when its channel
    count matches; otherwise (SD3, FLUX, tiny test models with other channel counts) a plain one: the first three
    channels as R, G, B, scaled so unit-variance latents fill the range. Rough, but shows composition and colour as
    they form."""
    fitted = family_info(family).latent_rgb
    if fitted is not None and len(fitted[0]) == channels:
        return np.array(fitted[0], np.float32), np.array(fitted[1], np.float32)
    weights = np.zeros((channels, 3), np.float32)
    for channel in range(min(channels, 3)):
        weights[channel, channel] = 0.5
    return weights, np.zeros(3, np.float32)


def preview(latents: np.ndarray, family: str, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] from the latents of one image ([C, h, w]; FLUX's packed [seq, C*4] is unpacked); a video's
    [C, f, h, w] gives [f, h, w, 3], one preview per latent frame (what the clip looks like so far)."""
    latents = np.asarray(latents, np.float32)
    if latents.ndim == 4:
        return np.stack([preview(latents[:, frame], family, height, width) for frame in range(latents.shape[1])])
    if latents.ndim == 2:  # FLUX packed: [(h/2)*(w/2), C*4] -> [C, h, w]
        h2, w2 = _packed_grid(latents.shape[0], height, width)
        channels = latents.shape[1] // 4
        latents = latents.reshape(h2, w2, channels, 2, 2).transpose(2, 0, 3, 1, 4).reshape(channels, h2 * 2, w2 * 2)
    weights, bias = latent_rgb_map(family, latents.shape[0])
    rgb = np.einsum("chw,cd->hwd", latents, weights) + bias  # about [-1, 1]
    return ((np.clip(rgb, -1.0, 1.0) + 1.0) * 127.5).round().astype(np.uint8)


def _packed_grid(sequence: int, height: int, width: int) -> tuple[int, int]:
    ratio = width / height
    h2 = max(1, int(round((sequence / ratio) ** 0.5)))
    return h2, sequence // h2
