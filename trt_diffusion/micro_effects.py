"""What a trained micro-model's LoRA, ControlNet and inpainting do, read from pixels (issue 43): the outlined-style
LoRA's share of outlined pictures, the ControlNet's overlap with the shapes its edges outline, and inpainting's
repaint inside the mask against its change outside it.

Each measure takes `draw(request_fields) -> uint8 [H, W, 3]`, one image for a GenerationRequest's fields (prompt,
seed, controlnet, control_image, workflow, init_image, mask...), so the same measure reads the PyTorch reference,
an engine pipeline in process or a served model. Scenes are drawn from fixed seeds: the same on every machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import synthetic_world as world
from .prompt_following import read_image, shape_overlap

Draw = Callable[[dict], np.ndarray]
STEPS = 20  # the request the micro-model's figures are measured at (its training record's grid)
GUIDANCE_SCALE = 5.0
CONTROL_SEED = 1234  # the scenes a ControlNet is asked to follow
INPAINT_SEED = 4321  # the scenes inpainting repaints
MASK_MARGIN = 3  # pixels around the shape's bounding box the inpainting mask also covers
LATENT_CELL = 8  # pixels per latent (the VAE's spatial factor): a mask is repainted in whole latent cells


def outlined_share(draw: Draw, prompts: Sequence[str], seed: int = 0) -> float:
    """Percent of the prompts' images drawn in the outlined style."""
    return 100.0 * float(np.mean([read_image(draw({"prompt": p, "seed": seed})).style == "outlined"
                                  for p in prompts]))


def control_scenes(count: int) -> list[world.Scene]:
    """One scene per grid prompt (cycling), at a seeded position and size: the edges a ControlNet is asked to
    follow."""
    rng = np.random.default_rng(CONTROL_SEED)
    grid, drawn = world.prompt_grid(), []
    for i in range(count):
        wanted, placed = world.parse_caption(grid[i % len(grid)]), world.random_scene(rng)
        drawn.append(world.Scene(wanted.shape, wanted.colour, wanted.background, placed.cx, placed.cy, placed.radius))
    return drawn


@dataclass(frozen=True)
class ControlFigures:
    mean_overlap: float  # intersection over union of the drawn shape and the control scene's shape
    share_at_least_0_7: float  # percent of the images whose overlap is at least 0.7
    images: int


def control_overlap(draw: Draw, controlnet: str, count: int = 12, seed: int = 0) -> ControlFigures:
    overlaps = [shape_overlap(draw({"prompt": scene.caption, "seed": seed, "controlnet": controlnet,
                                    "control_image": world.edge_map(scene)}), world.shape_mask(scene))
                for scene in control_scenes(count)]
    return ControlFigures(float(np.mean(overlaps)), 100.0 * float(np.mean(np.array(overlaps) >= 0.7)), len(overlaps))


def inpaint_cases(count: int) -> list[tuple[world.Scene, str, np.ndarray]]:
    """(the drawn scene, the prompt asking for its shape in another colour, the mask: the shape's bounding box and
    a margin, out to whole latent cells, uint8 0/255). Latent inpainting repaints whole latent cells: the part of a
    finer mask's cells outside it would be counted as change outside the mask that no latent mask can avoid."""
    rng = np.random.default_rng(INPAINT_SEED)
    cases = []
    for _ in range(count):
        scene = world.random_scene(rng)
        others = [c for c in world.PALETTE if c not in (scene.colour, scene.background)]
        colour = others[int(rng.integers(len(others)))]
        shape = world.shape_mask(scene)
        rows, cols = np.flatnonzero(shape.any(axis=1)), np.flatnonzero(shape.any(axis=0))
        mask = np.zeros(shape.shape, np.uint8)
        top, left = (max(v[0] - MASK_MARGIN, 0) // LATENT_CELL * LATENT_CELL for v in (rows, cols))
        bottom, right = (-(-(v[-1] + MASK_MARGIN + 1) // LATENT_CELL) * LATENT_CELL for v in (rows, cols))
        mask[top:bottom, left:right] = 255
        cases.append((scene, world.caption(scene.shape, colour, scene.background), mask))
    return cases


@dataclass(frozen=True)
class VaeFloors:
    """What the VAE alone does to a picture. round_trip(image): a plain encode/decode, the floor of an inpainting that
    pastes nothing back. latent_paste(init, target, mask): init's latents with target's pasted into the mask's latent
    cells, decoded: a perfect latent inpainting, whose change outside the mask beyond the round trip is what the
    decoder carries out of the repainted cells."""

    round_trip: Callable[[np.ndarray], np.ndarray]
    latent_paste: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class InpaintFigures:
    repainted: float  # percent of the images whose masked region reads as the prompt's colour
    outside_change: float  # mean absolute change outside the mask, levels of 255 (mean over the images)
    vae_round_trip_change: float  # the same for a plain VAE encode/decode of the input
    latent_paste_change: float  # the same for a perfect latent inpainting (VaeFloors.latent_paste)
    far_outside_change: float  # the change more than one latent cell away from the mask
    images: int

    @property
    def outside_within_round_trip(self) -> bool:
        """Issue 43's bar: outside the mask the image changes no more than the VAE round trip plus one level."""
        return self.outside_change <= self.vae_round_trip_change + 1.0


def _masked_colour(image: np.ndarray, mask: np.ndarray, background: str) -> str | None:
    """The palette colour most of the masked region's non-background pixels are nearest to."""
    names = list(world.PALETTE)
    palette = np.array([world.PALETTE[n] for n in names], np.float64)
    pixels = np.asarray(image, np.float64)[mask > 127]
    nearest = np.argmin(np.linalg.norm(pixels[:, None, :] - palette[None], axis=-1), axis=1)
    counts = np.bincount(nearest, minlength=len(names))
    counts[names.index(background)] = 0
    return names[int(np.argmax(counts))] if counts.any() else None


def _mean_change(picture: np.ndarray, init: np.ndarray, where: np.ndarray) -> float:
    return float(np.abs(picture.astype(np.float64) - init)[where].mean())


def inpaint_repaint(draw: Draw, floors: VaeFloors, count: int = 12, seed: int = 0,
                    strength: float = 1.0) -> InpaintFigures:
    """Inpaint each case's mask with the prompt's colour and compare the change outside the mask with the VAE's
    own floors (`floors`: vae_floors for a model folder)."""
    from scipy.ndimage import binary_dilation

    repainted, outside, trip, paste, far = [], [], [], [], []
    for scene, prompt, mask in inpaint_cases(count):
        init = world.draw(scene)
        asked = world.parse_caption(prompt).colour
        image = draw({"prompt": prompt, "seed": seed, "workflow": "inpaint", "init_image": init, "mask": mask,
                      "strength": strength})
        keep = mask <= 127
        distant = keep & ~binary_dilation(mask > 127, iterations=LATENT_CELL)
        change = np.abs(image.astype(np.float64) - init)
        repainted.append(_masked_colour(image, mask, scene.background) == asked)
        outside.append(float(change[keep].mean()))
        far.append(float(change[distant].mean()) if distant.any() else 0.0)
        trip.append(_mean_change(floors.round_trip(init), init, keep))
        paste.append(_mean_change(floors.latent_paste(init, world.draw(replace(scene, colour=asked)), mask), init, keep))
    return InpaintFigures(100.0 * float(np.mean(repainted)), float(np.mean(outside)), float(np.mean(trip)),
                          float(np.mean(paste)), float(np.mean(far)), len(repainted))


def vae_floors(model_dir) -> VaeFloors:
    """The folder's own VAE (fp32, latents at the distribution's mode) as VaeFloors."""
    from pathlib import Path

    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(Path(model_dir) / "vae", dtype=torch.float32)

    def encode(image: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(image.astype(np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
        return vae.encode(x).latent_dist.mode()

    def decode(latents: torch.Tensor) -> np.ndarray:
        y = vae.decode(latents).sample[0]
        return np.round(((y.clamp(-1, 1) + 1) * 127.5).permute(1, 2, 0).numpy()).astype(np.uint8)

    @torch.no_grad()
    def round_trip(image: np.ndarray) -> np.ndarray:
        return decode(encode(image))

    @torch.no_grad()
    def latent_paste(init: np.ndarray, target: np.ndarray, mask: np.ndarray) -> np.ndarray:
        cells = torch.from_numpy((mask[::LATENT_CELL, ::LATENT_CELL] > 127).astype(np.float32))[None, None]
        return decode(encode(init) * (1 - cells) + encode(target) * cells)

    return VaeFloors(round_trip, latent_paste)


def as_dict(figures) -> dict:
    extra = {"outside_within_round_trip": figures.outside_within_round_trip} \
        if isinstance(figures, InpaintFigures) else {}
    return {**asdict(figures), **extra}
