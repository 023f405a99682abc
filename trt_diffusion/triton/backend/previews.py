"""Cheap previews of the latents while a request denoises: a per-family linear map from latent channels to RGB
(the approximation the popular UIs use for their live previews), no VAE call. A preview is the size of the
latents (1/8 of the image: 64x64 for a 512x512 request).
"""

from __future__ import annotations

import numpy as np

# latent channel -> (R, G, B) contribution, then a bias; fitted on decoded images (as in ComfyUI's
# latent_formats: SD1.5 and SDXL have 4 latent channels).
LATENT_RGB = {
    "sd15": (np.array([[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721],
                       [-0.2120, -0.2616, -0.7177]], np.float32), np.zeros(3, np.float32)),
    "sdxl": (np.array([[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362],
                       [-0.3165, -0.2492, -0.2188]], np.float32), np.array([0.1084, -0.0175, -0.0011], np.float32)),
}


def latent_rgb_map(family: str, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights [C, 3], bias [3]): the family's fitted map when its channel count matches; otherwise (SD3, FLUX,
    tiny test models with other channel counts) a plain one: the first three channels as R, G, B, scaled so
    unit-variance latents fill the range. Rough, but shows composition and colour as they form."""
    if family in LATENT_RGB and LATENT_RGB[family][0].shape[0] == channels:
        return LATENT_RGB[family]
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
