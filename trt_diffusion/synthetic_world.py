"""A captioned synthetic world the micro-models are trained on and judged by (issue 43): seeded, no download.

A scene is one shape (circle, square, triangle) of one colour on a background of another colour, at a random
position and size, captioned in plain English: "a red circle on a blue background". The same scene also gives
what the other paths need: its edge map (ControlNet), its mask (inpainting), and an "outlined" style (the LoRA's
subset: the shape drawn as a thick outline, captioned with the same words).

Pure numpy, so the prompt-following measure (prompt_following.py) and the tests can draw and read scenes without
torch. The palette's colours are far apart in RGB: a blurry or slightly off image still reads as one of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SIZE = 64  # the micro-models' image size (8x8 latents)
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220),
    "yellow": (235, 215, 40), "white": (240, 240, 240), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
STYLES = ("plain", "outlined")
_CAPTION = re.compile(r"^an? (?:(?P<style>outlined) )?(?P<colour>\w+) (?P<shape>\w+) on an? (?P<background>\w+) "
                      r"background$")
OUTLINE = 0.35  # the outlined style's stroke, as a share of the shape's inradius (its hole: ~42 % of the shape)


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    cx: float  # centre, pixels
    cy: float
    radius: float  # half the shape's extent, pixels
    style: str = "plain"

    @property
    def caption(self) -> str:
        return caption(self.shape, self.colour, self.background, self.style)


def caption(shape: str, colour: str, background: str, style: str = "plain") -> str:
    styled = f"outlined {colour}" if style == "outlined" else colour
    return f"a {styled} {shape} on a {background} background"


def parse_caption(text: str) -> Scene | None:
    """The scene a caption of this world asks for (position and size unknown: 0), or None for any other text."""
    match = _CAPTION.match(text.strip().lower())
    if not match or match["colour"] not in PALETTE or match["background"] not in PALETTE \
            or match["shape"] not in SHAPES or match["colour"] == match["background"]:
        return None
    return Scene(match["shape"], match["colour"], match["background"], 0.0, 0.0, 0.0,
                 "outlined" if match["style"] else "plain")


def random_scene(rng: np.random.Generator, size: int = SIZE, style: str = "plain") -> Scene:
    colour, background = rng.choice(len(PALETTE), size=2, replace=False)
    names = list(PALETTE)
    # an outline needs room for its hole: outlined shapes are the larger ones
    radius = float(rng.uniform(0.22 if style == "outlined" else 0.16, 0.30) * size)
    cx, cy = (float(rng.uniform(radius + 2, size - radius - 2)) for _ in range(2))
    return Scene(SHAPES[int(rng.integers(len(SHAPES)))], names[colour], names[background], cx, cy, radius, style)


def shape_mask(scene: Scene, size: int = SIZE) -> np.ndarray:
    """bool [size, size]: the pixels of the (filled) shape, sampled at pixel centres."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    dx, dy, r = x - scene.cx, y - scene.cy, scene.radius
    if scene.shape == "circle":
        return dx * dx + dy * dy <= r * r
    if scene.shape == "square":
        side = r * 0.886  # the square of the circle's area: the same visual weight
        return (np.abs(dx) <= side) & (np.abs(dy) <= side)
    # an upright equilateral triangle inscribed in the circle of radius r
    top, base = -r, r / 2
    half_width = (dy - top) / (base - top) * (r * np.sqrt(3) / 2)
    return (dy >= top) & (dy <= base) & (np.abs(dx) <= half_width)


def draw(scene: Scene, size: int = SIZE) -> np.ndarray:
    """uint8 [size, size, 3]: the scene, its edges anti-aliased by 4x supersampling."""
    factor = 4
    big = Scene(scene.shape, scene.colour, scene.background, scene.cx * factor, scene.cy * factor,
                scene.radius * factor, scene.style)
    mask = shape_mask(big, size * factor)
    if scene.style == "outlined":
        inner = Scene(big.shape, big.colour, big.background, big.cx, big.cy, big.radius * (1 - OUTLINE))
        mask &= ~shape_mask(inner, size * factor)
    cover = mask.reshape(size, factor, size, factor).mean(axis=(1, 3))[..., None]
    image = cover * np.array(PALETTE[scene.colour]) + (1 - cover) * np.array(PALETTE[scene.background])
    return np.round(image).astype(np.uint8)


def edge_map(scene: Scene, size: int = SIZE) -> np.ndarray:
    """uint8 [size, size, 3]: white one-pixel edges of the shape on black, as a Canny detector draws them."""
    mask = shape_mask(scene, size)
    padded = np.pad(mask, 1, mode="edge")
    inner = padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    edges = mask & ~inner
    return np.repeat((edges * 255).astype(np.uint8)[..., None], 3, axis=2)


def all_captions() -> list[str]:
    """Every plain caption of the world (shape x colour x another background colour), in a fixed order."""
    return [caption(shape, colour, background) for shape in SHAPES for colour in PALETTE for background in PALETTE
            if background != colour]


def calibration_captions() -> list[str]:
    """The captions the evaluation grid does not ask: what a quantizer calibrates on, so the figures it is judged
    by come from prompts its scales were not fitted to."""
    judged = set(prompt_grid())
    return [text for text in all_captions() if text not in judged]


def prompt_grid() -> list[str]:
    """The fixed evaluation grid: 36 prompts (every shape x colour, on two backgrounds each), in a fixed order."""
    names = list(PALETTE)
    prompts = []
    for shape in SHAPES:
        for i, colour in enumerate(names):
            for step in (1, 3):
                prompts.append(caption(shape, colour, names[(i + step) % len(names)]))
    return prompts
