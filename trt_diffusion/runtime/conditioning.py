"""Image-conditioned starts (img2img, inpaint) as diffusers' pipelines make them, over runners.

What differs from text-to-image is where the loop starts and what it keeps: the init image is VAE-encoded (a
latent *sampled* with the request's generator, mean + std * randn, as `retrieve_latents` does), `strength` trims
the schedule's head, the start latents are the image's noised to the first kept timestep, and inpainting either
feeds the mask and the masked image's latents to a 9/33-channel denoiser or blends the known region back after
every step (4/16-channel denoisers). Every draw from the generator happens in diffusers' order, so the reference
runners reproduce diffusers' images exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..families import Family, family_info
from ..workflows import Workflow


def _flow(family: Family) -> bool:
    """Flow matching (the family's declaration): scale_noise, the float product of steps and strength;
    (x - shift) * scale latents (Qwen-Image normalizes per channel: runtime/qwen_image_loop.QwenLatentEncoder)."""
    return family_info(family).flow_matching


@dataclass
class ImageStart:
    """A request's image-conditioned state for the loop: what the start latents were made from and what the
    per-step inpainting work needs (None where the workflow does not use it)."""

    timesteps: torch.Tensor  # the trimmed schedule the loop runs
    image_latents: torch.Tensor | None = None  # the init image's latents, repeated to the request's rows
    noise: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [rows, 1, h, w] at latent size; 1 = repaint
    masked_image_latents: torch.Tensor | None = None  # the extra channels of an inpainting denoiser
    blend: bool = False  # a plain denoiser inpaints: blend the known region back after each step


def image_tensor(image: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] -> float32 [1, 3, H, W] in [-1, 1], as VaeImageProcessor.preprocess does for a PIL image,
    memory layout included: it permutes HWC to NCHW without a copy (channels-last strides), and convolutions
    round differently over that layout than over a contiguous copy (~1e-6, which shows after a few steps)."""
    array = (image.astype(np.float32) / 255.0)[None]
    return torch.from_numpy(array.transpose(0, 3, 1, 2)) * 2.0 - 1.0


def mask_tensor(mask: np.ndarray) -> torch.Tensor:
    """uint8 [H, W] -> float32 [1, 1, H, W] of 0/1: diffusers' mask processor (grayscale, /255, binarised at
    0.5, no blur). White (>= 128) is repainted."""
    array = mask.astype(np.float32) / 255.0
    array = np.where(array < 0.5, 0.0, 1.0).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(array[None, None]))


def _first_kept_step(steps: int, strength: float, family: Family) -> int:
    """Where `get_timesteps` starts the schedule. The UNet pipelines round the kept count down to an integer;
    SD3's and FLUX's keep the float product."""
    kept = min(steps * strength, steps) if _flow(family) else min(int(steps * strength), steps)
    return int(max(steps - kept, 0))


def trim_timesteps(scheduler, steps: int, strength: float, family: Family) -> torch.Tensor:
    """The kept tail of the schedule (`get_timesteps`), with the scheduler's begin index set to its start."""
    start = _first_kept_step(steps, strength, family)
    timesteps = scheduler.timesteps[start * scheduler.order:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start * scheduler.order)
    return timesteps


def kept_steps(steps: int, strength: float, family: Family) -> int:
    """How many denoiser steps a request runs (for validation: diffusers refuses fewer than one)."""
    return steps - _first_kept_step(steps, strength, family)


class LatentEncoder:
    """The VAE encoder runner and the family's latent scaling: encode(image) samples the latent as diffusers'
    `retrieve_latents(vae.encode(x), generator)` does, then scales it for the denoiser."""

    def __init__(self, runner, family: Family, scaling_factor: float, shift_factor: float):
        self.runner, self.family = runner, family
        self.scaling_factor, self.shift_factor = scaling_factor, shift_factor

    def encode(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        outputs = self.runner.run({"images": image.numpy()})  # its layout kept (image_tensor)
        mean = torch.from_numpy(np.asarray(outputs["latent"], np.float32))
        std = torch.from_numpy(np.asarray(outputs["latent_std"], np.float32))
        return self._scaled(mean + std * torch.randn(mean.shape, generator=generator, dtype=mean.dtype))

    def mode(self, image: torch.Tensor) -> torch.Tensor:
        """The latent's mean, scaled: `retrieve_latents(..., sample_mode="argmax")` (FLUX.1 Kontext's context
        image), which draws nothing from the generator."""
        outputs = self.runner.run({"images": image.numpy()})
        return self._scaled(torch.from_numpy(np.asarray(outputs["latent"], np.float32)))

    def _scaled(self, sample: torch.Tensor) -> torch.Tensor:
        if _flow(self.family):
            return (sample - self.shift_factor) * self.scaling_factor
        return self.scaling_factor * sample


def add_noise(scheduler, family: Family, latents: torch.Tensor, noise: torch.Tensor, timestep) -> torch.Tensor:
    """The image latents noised to `timestep` (a 1-element or per-row tensor)."""
    if _flow(family):
        return scheduler.scale_noise(latents, timestep, noise)
    return scheduler.add_noise(latents, noise, timestep)


def image_start(workflow: Workflow, *, request, scheduler, generator: torch.Generator, encoder: LatentEncoder,
                family: Family, shape: tuple[int, ...], denoiser_channels: int, init_noise_sigma: float
                ) -> tuple[torch.Tensor, ImageStart]:
    """(start latents, ImageStart) for an img2img or inpaint request, drawing from `generator` in diffusers'
    order: the init image's latent sample, then the noise, then (inpaint) the masked image's latent sample."""
    rows, latent_channels = shape[0], shape[1]
    timesteps = trim_timesteps(scheduler, request.steps, request.strength, family)
    first = timesteps[:1].repeat(rows)
    image = image_tensor(request.init_image)
    if workflow is Workflow.img2img:
        image_latents = repeat_rows(encoder.encode(image, generator), rows)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        return add_noise(scheduler, family, image_latents, noise, first), ImageStart(timesteps)

    # inpaint
    blend = denoiser_channels == latent_channels
    if not blend and denoiser_channels != 2 * latent_channels + 1:
        raise ValueError(f"an inpainting denoiser takes {latent_channels} or {2 * latent_channels + 1} input "
                         f"channels, this one {denoiser_channels}")
    full_strength = request.strength == 1.0
    image_latents = None
    if blend or not full_strength:  # diffusers encodes the init image only where it is used
        encoded = encoder.encode(image, generator)
        # always `repeat`, as diffusers' inpaint prepare_latents does even at one row: the copy is contiguous
        # where the encoder's output is channels-last, and the VAE decoder rounds by layout
        image_latents = encoded.repeat(rows // encoded.shape[0], 1, 1, 1)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if full_strength:
        latents = noise if _flow(family) else noise * init_noise_sigma
    else:
        latents = add_noise(scheduler, family, image_latents, noise, first)
    mask = mask_tensor(request.mask)
    masked_image_latents = repeat_rows(encoder.encode(image * (mask < 0.5), generator), rows)
    latent_mask = repeat_rows(torch.nn.functional.interpolate(mask, size=tuple(shape[2:])), rows)
    return latents, ImageStart(timesteps, image_latents, noise, latent_mask, masked_image_latents, blend)


def noised_image(encoder: LatentEncoder, image: torch.Tensor, generator: torch.Generator, scheduler,
                 timesteps: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(image latents, noise, start latents) of the packed flow loops' img2img and inpaint (FLUX, Qwen-Image), in
    their pipelines' draw order: the init image's latent sample (one, repeated to the rows), then the noise in its
    shape; the latents noised to the first kept timestep. Unpacked [rows, C, h, w]."""
    image_latents = repeat_rows(encoder.encode(image, generator), rows)
    noise = torch.randn(image_latents.shape, generator=generator, dtype=torch.float32)
    return image_latents, noise, scheduler.scale_noise(image_latents, timesteps[:1].repeat(rows), noise)


def packed_blend(timesteps: torch.Tensor, image_latents: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor,
                 pack) -> ImageStart:
    """A plain packed transformer's inpaint state: the request's mask nearest-resized to the latent grid, repeated
    to the rows and over the channels, packed with the image latents and the noise as `pack` packs latents."""
    rows, channels, h, w = image_latents.shape
    latent_mask = repeat_rows(torch.nn.functional.interpolate(mask, size=(h, w)), rows).repeat(1, channels, 1, 1)
    return ImageStart(timesteps, image_latents=pack(image_latents), noise=pack(noise), mask=pack(latent_mask),
                      blend=True)


def inpaint_channels(start: ImageStart, scaled: torch.Tensor) -> torch.Tensor:
    """An inpainting denoiser's input: the scaled latents, the mask and the masked image's latents."""
    return torch.cat([scaled, start.mask, start.masked_image_latents], dim=1)


def blend_known_region(start: ImageStart, scheduler, family: Family, latents: torch.Tensor, index: int
                       ) -> torch.Tensor:
    """After step `index`, the known region (mask 0) put back as the init image noised to the next timestep
    (un-noised after the last step), as diffusers does for plain-denoiser inpainting."""
    proper = start.image_latents
    if index < len(start.timesteps) - 1:
        proper = add_noise(scheduler, family, proper, start.noise, torch.tensor([start.timesteps[index + 1]]))
    return (1 - start.mask) * proper + start.mask * latents


def repeat_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """One image's tensor repeated to the request's rows (diffusers' torch.cat([x] * n): the same values)."""
    return tensor.repeat(rows // tensor.shape[0], *([1] * (tensor.ndim - 1))) if tensor.shape[0] < rows else tensor
