"""Wan image-to-video conditioning over runners, as diffusers' `WanImageToVideoPipeline` builds it (its
`encode_image` and `prepare_latents`; no `expand_timesteps` — Wan 2.2 TI2V-5B —, no `last_image`):

- image embeds (Wan 2.1 I2V only: the transformer config's `image_dim`): the folder's own CLIP image processor on
  the PIL image, the image_encoder runner at batch 1 (CLIP's penultimate hidden states), repeated to the request's
  rows. diffusers repeats them by the prompt count alone, so its `num_videos_per_prompt > 1` fails in the
  transformer's concat (huggingface/diffusers#13578); the rows here are what its fix (#14170) repeats to, and what
  the pipeline gets when it is handed the prompt embeds of those rows. The conditional and unconditional calls
  share them.
- the conditioning clip: VideoProcessor.preprocess of the image at the request's size, then F - 1 black frames,
  VAE-encoded whole (the encoder's causal cache runs over the frames, so its engine is per frame count) to the
  latent distribution's mode — argmax: no draw from the generator, so the noise drawn before it is the request's
  only draw, as in diffusers. Normalised `(latent - mean) * (1 / std)` and repeated to the rows.
- the first-frame mask: 1 over the frames that are given (the first, counted 4 times so the mask packs into the
  VAE's 4-frame latent steps), 0 elsewhere, as 4 channels per latent frame; the condition is [mask, latents]
  (4 + 16 channels), concatenated to the noisy latents at every step (36 channels in).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..engines_file.engine_spec import Size
from ..errors import ModelError


@dataclass
class ImageCondition:
    """What every transformer call of an img2vid request gets beside its latents."""

    channels: torch.Tensor  # [rows, 4 + z, f, h, w]: the first-frame mask, then the conditioning clip's latents
    embeds: np.ndarray | None  # [rows, T, D] CLIP image embeds (Wan 2.1 I2V); None where the transformer has none


class ImageConditioner:
    """An image-to-video checkpoint's host-side processors and the recipe; the runners come with each call (the
    loop's table, which runners_swapped replaces)."""

    def __init__(self, model_dir: Path, index: dict, denoiser_config: dict, vae_config: dict, *,
                 latents_mean: torch.Tensor, latents_std: torch.Tensor, temporal_factor: int):
        from diffusers.video_processor import VideoProcessor

        # the pipeline's own: VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
        self.video_processor = VideoProcessor(vae_scale_factor=int(vae_config.get("scale_factor_spatial", 8)))
        self.latents_mean, self.latents_std = latents_mean, latents_std  # WanLoop's: std already inverted
        self.temporal_factor = temporal_factor
        # diffusers asks the (first) transformer's config whether it takes image embeds
        self.clip_processor = (_clip_processor(Path(model_dir), index)
                               if denoiser_config.get("image_dim") is not None else None)

    @property
    def components(self) -> tuple[str, ...]:
        """The runners img2vid calls beside the transformer(s) and the VAE decoder."""
        return ("image_encoder", "vae_encoder") if self.clip_processor is not None else ("vae_encoder",)

    def condition(self, runners, image: np.ndarray, size: Size, rows: int) -> ImageCondition:
        """`image` uint8 [H, W, 3] at the request's size; `size` carries the request's frames."""
        from PIL import Image

        picture = Image.fromarray(image)  # the PIL image a caller hands diffusers' pipeline
        embeds = None if self.clip_processor is None else self._embeds(runners, picture, rows)
        pixels = self.video_processor.preprocess(picture, height=size.height, width=size.width).to(torch.float32)
        first = pixels.unsqueeze(2)  # [1, 3, 1, H, W]
        clip = torch.cat([first, first.new_zeros(1, 3, size.frames - 1, size.height, size.width)], dim=2)
        runner = runners.find("vae_encoder", size=size, batch=1)
        latent = torch.from_numpy(np.asarray(runner.run({"video": clip.numpy()})["latent"], np.float32))
        latent = latent.repeat(rows, 1, 1, 1, 1)
        latent = (latent - self.latents_mean) * self.latents_std
        mask = first_frame_mask(rows, size.frames, *latent.shape[-2:], self.temporal_factor)
        return ImageCondition(torch.concat([mask, latent], dim=1), embeds)

    def _embeds(self, runners, picture, rows: int) -> np.ndarray:
        pixels = self.clip_processor(images=picture, return_tensors="pt").pixel_values  # encode_image's call
        runner = runners.find("image_encoder", size=None, batch=1)
        embeds = runner.run({"pixel_values": pixels.numpy()})["image_embeds"]
        return np.repeat(embeds, rows, axis=0)  # image_embeds.repeat(rows, 1, 1) of one image: the same rows


def first_frame_mask(rows: int, frames: int, height: int, width: int, temporal_factor: int) -> torch.Tensor:
    """prepare_latents' mask, line for line: [rows, temporal_factor, f, h, w], 1 where a frame is given."""
    mask = torch.ones(rows, 1, frames, height, width)
    mask[:, :, list(range(1, frames))] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal_factor)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
    return mask.view(rows, -1, temporal_factor, height, width).transpose(1, 2)


def _clip_processor(model_dir: Path, index: dict):
    """The folder's image processor loaded as diffusers loads it: the class model_index.json names, from the
    library it names. Without torchvision transformers gives CLIPImageProcessor's PIL backend either way (a
    folder saved then names CLIPImageProcessorPil), so the pixels are those the pipeline computes."""
    from ..models.loading import LIBRARIES

    entry = index.get("image_processor") or [None, None]
    library, class_name = (list(entry) + [None, None])[:2] if isinstance(entry, list) else (entry, None)
    if not library or not class_name or not (model_dir / "image_processor").is_dir():
        raise ModelError("this Wan transformer attends to image embeddings (image_dim in its config.json), but the "
                         "model folder has no image_processor (model_index.json and image_processor/) to make "
                         "the CLIP image encoder's pixels")
    # model_index.json is data: only a class of the two libraries the loaders allow is imported (never any module
    # a folder names), and it must be a processor class (from_pretrained), not another attribute
    refused = ModelError(f"{model_dir / 'model_index.json'}: image_processor names {entry!r}; only diffusers and "
                         "transformers classes are loaded")
    if library not in LIBRARIES or not isinstance(class_name, str) or not class_name.isidentifier():
        raise refused
    cls = getattr(importlib.import_module(library), class_name, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "from_pretrained", None)):
        raise refused
    return cls.from_pretrained(model_dir / "image_processor")
