"""Seeded input images, masks and ControlNet edge maps for the image-conditioned workflows: what parity, preflight, the server's
warm-up and the tests feed img2img, inpaint, edit and img2vid requests (img2vid's init image is the clip's first
frame). Generated, never downloaded, the same on every machine (numpy's PCG64)."""

from __future__ import annotations

import numpy as np

from .families import family_info
from .workflows import Workflow


def init_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [H, W, 3]: a smooth colour field with a few discs, structure a VAE keeps and a denoiser can follow."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y, x = y / max(height - 1, 1), x / max(width - 1, 1)
    phase = rng.uniform(0, 2 * np.pi, 3)
    freq = rng.uniform(1.0, 3.0, 3)
    image = np.stack([0.5 + 0.4 * np.sin(2 * np.pi * f * (x + y) / 2 + p) for f, p in zip(freq, phase)], -1)
    for _ in range(3):
        cy, cx, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.08, 0.2)
        inside = (y - cy) ** 2 + (x - cx) ** 2 < r * r
        image[inside] = rng.uniform(0, 1, 3)
    return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)


def control_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [H, W, 3]: a synthetic edge map (six full-length white lines), what a canny ControlNet sees; the one
    parity and preflight feed."""
    rng = np.random.default_rng(seed)
    image = np.zeros((height, width, 3), np.uint8)
    for _ in range(6):
        y, x = rng.integers(0, height), rng.integers(0, width)
        image[y, :, :] = 255
        image[:, x, :] = 255
    return image


def inpaint_mask(height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [H, W] of 0/255: a rectangle to repaint (white), between a quarter and a half of each side."""
    rng = np.random.default_rng(seed + 1_000_003)
    mask = np.zeros((height, width), np.uint8)
    h, w = int(height * rng.uniform(0.25, 0.5)), int(width * rng.uniform(0.25, 0.5))
    top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
    mask[top:top + h, left:left + w] = 255
    return mask


def workflow_inputs(workflow: Workflow, height: int, width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The seeded `init_image` (and `mask`) a workflow's requests start from, at the request's height x width
    (images are never resized: a video's is one frame of the bucket); none for txt2img."""
    if not workflow.needs_image:
        return {}
    inputs = {"init_image": init_image(height, width, seed)}
    if workflow.needs_mask:
        inputs["mask"] = inpaint_mask(height, width, seed)
    return inputs


def natural_workflow(workflows) -> Workflow:
    """What a request that is not about workflows asks a model for (a first request, a warm-up, the checks that
    time or load a server): txt2img where the model serves it, else the first workflow it declares. An
    image-to-video checkpoint serves img2vid alone, so a txt2img request to it would be refused."""
    served = [Workflow(w) for w in workflows] or [Workflow.txt2img]
    return Workflow.txt2img if Workflow.txt2img in served else served[0]


def cfg_fields(family) -> dict:
    """Request fields that make a sample request run the family's CFG the way users' requests do: Qwen-Image's true
    CFG runs only with a negative prompt (diffusers' do_true_cfg), so its sample requests carry an empty one (its
    second transformer call and the norm rescale are then warmed and timed too); none elsewhere, where CFG runs on
    GUIDANCE_SCALE alone."""
    negative = family_info(family).reference_guidance.get("negative_prompt")  # the family's declaration
    return {} if negative is None else {"negative_prompt": negative}


def request_fields(workflow: Workflow, height: int, width: int, seed: int = 0) -> dict:
    """`workflow` and its seeded inputs as request fields (GenerationRequest's and ImageRequest's names); none for
    txt2img, whose requests stay as they were before workflows."""
    workflow = Workflow(workflow)
    if workflow is Workflow.txt2img:
        return {}
    return {"workflow": workflow.value, **workflow_inputs(workflow, height, width, seed)}
