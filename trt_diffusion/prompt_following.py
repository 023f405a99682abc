"""Does an image still draw its prompt? A reading from pixels, no learned judge (issue 43).

For a prompt of the synthetic world ("a red circle on a blue background", synthetic_world.py) an image is read
as: the background colour (the median of its outer ring, to the nearest palette colour), the shape (the pixels
far from that background), the shape's colour (their median, to the nearest palette colour), its class (the
template — ellipse, box or upright triangle — fitted to the shape's bounding box that overlaps it best) and its
style (plain, or outlined when the shape covers little of its own template). A grid of images gives the share
of each that matches its prompt. A prompt outside the world's vocabulary is "not applicable": None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .synthetic_world import PALETTE, SHAPES, parse_caption

RING = 2  # pixels of the border read as background (shapes keep 2 px clear of it)
SHAPE_DISTANCE = 70.0  # RGB distance from the background beyond which a pixel belongs to the shape
MIN_SHAPE_PIXELS = 12
OUTLINED_COVER = 0.72  # below this share of its template the shape is an outline (a filled one covers ~0.9+)
ASPECTS = ("background", "colour", "shape")


@dataclass(frozen=True)
class Reading:
    background: str
    colour: str | None  # None: no shape found
    shape: str | None
    style: str | None


def _nearest(rgb: np.ndarray) -> str:
    names = list(PALETTE)
    distances = [float(np.linalg.norm(rgb - np.array(PALETTE[n], dtype=np.float64))) for n in names]
    return names[int(np.argmin(distances))]


def _templates(top: int, bottom: int, left: int, right: int, size: tuple[int, int]) -> dict[str, np.ndarray]:
    y, x = np.mgrid[0:size[0], 0:size[1]].astype(np.float64) + 0.5
    cy, cx = (top + bottom + 1) / 2, (left + right + 1) / 2
    ry, rx = max((bottom + 1 - top) / 2, 0.5), max((right + 1 - left) / 2, 0.5)
    box = (y >= top) & (y <= bottom + 1) & (x >= left) & (x <= right + 1)
    ellipse = ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1
    height = bottom + 1 - top
    triangle = box & (np.abs(x - cx) <= rx * (y - top) / max(height, 1))
    return {"circle": ellipse, "square": box, "triangle": triangle}


def _background_and_shape(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ring = np.concatenate([pixels[:RING].reshape(-1, 3), pixels[-RING:].reshape(-1, 3),
                           pixels[:, :RING].reshape(-1, 3), pixels[:, -RING:].reshape(-1, 3)])
    background_rgb = np.median(ring, axis=0)
    return background_rgb, np.linalg.norm(pixels - background_rgb, axis=-1) > SHAPE_DISTANCE


def shape_overlap(image: np.ndarray, wanted: np.ndarray) -> float:
    """Intersection over union of the image's shape pixels (those far from its background) and a wanted bool mask
    of the same size: how closely a ControlNet's picture follows the shape its edges outline."""
    _, mask = _background_and_shape(np.asarray(image, dtype=np.float64)[..., :3])
    union = (mask | wanted).sum()
    return float((mask & wanted).sum() / union) if union else 1.0


def read_image(image: np.ndarray) -> Reading:
    """What a uint8 [H, W, 3] image of the synthetic world shows."""
    pixels = np.asarray(image, dtype=np.float64)[..., :3]
    background_rgb, mask = _background_and_shape(pixels)
    background = _nearest(background_rgb)
    if mask.sum() < MIN_SHAPE_PIXELS:
        return Reading(background, None, None, None)
    colour = _nearest(np.median(pixels[mask], axis=0))
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    templates = _templates(rows[0], rows[-1], cols[0], cols[-1], mask.shape)
    overlaps = {name: (mask & t).sum() / max((mask | t).sum(), 1) for name, t in templates.items()}
    shape = max(SHAPES, key=lambda name: overlaps[name])
    cover = (mask & templates[shape]).sum() / max(templates[shape].sum(), 1)
    return Reading(background, colour, shape, "outlined" if cover < OUTLINED_COVER else "plain")


def follows(image: np.ndarray, prompt: str) -> dict[str, bool] | None:
    """aspect -> whether the image shows what the prompt asks (and `style` for a styled prompt); None when the
    prompt is not of the synthetic world (a user's checkpoint: not applicable)."""
    wanted = parse_caption(prompt)
    if wanted is None:
        return None
    seen = read_image(image)
    return {"background": seen.background == wanted.background, "colour": seen.colour == wanted.colour,
            "shape": seen.shape == wanted.shape, "style": seen.style == wanted.style}


def grid_figures(images: Sequence[np.ndarray], prompts: Sequence[str]) -> dict[str, float] | None:
    """aspect -> percent of the images that match their prompt (the aspects of ASPECTS and `style`); None when
    any prompt is outside the synthetic world."""
    verdicts = [follows(image, prompt) for image, prompt in zip(images, prompts, strict=True)]
    if not verdicts or any(v is None for v in verdicts):
        return None
    return {aspect: 100.0 * sum(v[aspect] for v in verdicts) / len(verdicts) for aspect in (*ASPECTS, "style")}
