"""The `FamilyLoop` protocol (validate → encode → denoise → decode) and one adapter per family loop, so
`EnginePipeline` dispatches to its family's loop without a branch per family. Every family's declaration names its
adapter lazily (`families/<name>.py` `loop = "trt_diffusion.runtime.family_loops:…"`; SD1.5, SDXL and SD3 name
runtime/unet_loop.py's). Each adapter wraps the loop class that holds the family's computation (`inner`), calling
it exactly as the pipeline's branches did, so every reference stays bit for bit what it was."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from ..engines_file.engine_spec import Size
from ..errors import InternalError
from ..families import family_info
from ..workflows import EDIT_PIPELINE_CLASSES
from .engines import RunnerTable
from .flux2_loop import Flux2Loop
from .flux_loop import FluxLoop
from .qwen_image_loop import EditParts, QwenImageLoop, QwenText
from .requests import PromptEncoding, StageTimings, StepCallback, _Conditioning
from .video_loop import WanLoop


class FamilyLoop(Protocol):
    """What a family's own loop answers for `EnginePipeline`."""

    inner: Any  # the loop class holding the family's computation (FluxLoop, WanLoop, …)
    batches_requests: bool
    """Requests of one batch_key share denoiser calls (`denoise_together`, the UNet/SD3 loop's); False: each
    request runs alone."""

    @property
    def runners(self) -> RunnerTable: ...

    @runners.setter
    def runners(self, value: RunnerTable) -> None: ...

    def runs_cfg(self, request) -> bool:
        """Whether the request's denoiser runs twice per step."""

    def encode(self, request) -> PromptEncoding: ...

    def denoise(self, request, encoding: PromptEncoding, size: Size, timings: StageTimings,
                on_step: StepCallback | None, threshold: float | None) -> tuple[torch.Tensor, str]:
        """(final latents, cfg mode)."""

    def decode(self, latents: torch.Tensor, size: Size, batch: int) -> np.ndarray:
        """The VAE's pixels in [-1, 1], channels on axis 1 (the pipeline makes them uint8)."""


class LoopAdapter:
    inner: Any
    image_condition: Any = None  # img2vid's image conditioner (Wan I2V), else None
    batches_requests = False  # one request per batch (the family loops say why)

    @property
    def runners(self) -> RunnerTable:
        return self.inner.runners

    @runners.setter
    def runners(self, value: RunnerTable) -> None:
        self.inner.runners = value

    def runs_cfg(self, request) -> bool:
        return request.guidance_scale > 1.0

    def decode(self, latents: torch.Tensor, size: Size, batch: int) -> np.ndarray:
        return self.inner.decode(latents, size, batch)


def negative_embeds(encoding: PromptEncoding):
    return None if encoding.negative is None else encoding.negative.embeds


class FluxFamilyLoop(LoopAdapter):
    """FLUX.1: the hub's CLIP + T5 prompt encoding and VAE decode around FluxLoop (guidance embedded: one call per
    step; a transformer without the embedding runs true CFG where the request asks: FluxLoop.true_cfg)."""

    def __init__(self, hub):
        self.inner = FluxLoop(
            hub.runners, hub.denoiser_config, hub.scheduler_config, latent_channels=hub.latent_channels,
            vae_scale_factor=hub.vae_scale_factor, scaling_factor=hub.scaling_factor,
            shift_factor=hub.shift_factor, denoiser=hub.denoiser, family=hub.family)
        self._encode_all: Callable = hub._encode_all
        self._decode_vae: Callable = hub._decode_vae

    def runs_cfg(self, request) -> bool:
        return self.inner.true_cfg(request)

    def encode(self, request) -> PromptEncoding:
        negative = None
        if self.inner.true_cfg(request):
            negative = self._encode_all([request.negative_prompt] * request.batch)
        return PromptEncoding(self._encode_all([request.prompt] * request.batch), negative)

    def denoise(self, request, encoding, size, timings, on_step, threshold):
        item = self.inner.item(request, encoding.positive, size, negative=encoding.negative)
        latents = self.inner.denoise(item, size, timings, on_step, threshold=threshold)
        return latents, "none" if encoding.negative is None else "split"

    def decode(self, latents, size, batch):
        return self._decode_vae(latents, size, batch)


class WanFamilyLoop(LoopAdapter):
    def __init__(self, hub):
        self.inner = WanLoop(
            hub.runners, hub.index, hub.denoiser_config, hub.scheduler_config, hub.vae_config,
            hub.tokenizers["tokenizer"], vae_scale_factor=hub.vae_scale_factor, parallel_cfg=hub.parallel_cfg,
            model_dir=hub.model_dir, family=hub.family)

    @property
    def image_condition(self):
        return self.inner.image

    def encode(self, request) -> PromptEncoding:
        positive, negative = self.inner.encode(request)
        return PromptEncoding(_Conditioning(positive), None if negative is None else _Conditioning(negative))

    def denoise(self, request, encoding, size, timings, on_step, threshold):
        return self.inner.denoise(request, encoding.positive.embeds, negative_embeds(encoding), timings, on_step)


class QwenImageFamilyLoop(LoopAdapter):
    def __init__(self, hub):
        edit = EditParts.load(hub.model_dir) if hub.index.get("_class_name") in EDIT_PIPELINE_CLASSES else None
        self.inner = QwenImageLoop(
            hub.runners, hub.denoiser_config, hub.scheduler_config, hub.vae_config, hub.tokenizers["tokenizer"],
            vae_scale_factor=hub.vae_scale_factor, text_lengths=hub.text_lengths, edit=edit, family=hub.family)

    def encode(self, request) -> PromptEncoding:
        positive, negative = self.inner.encode(request)
        return PromptEncoding(_Conditioning(positive.embeds, mask=positive.mask),
                              None if negative is None else _Conditioning(negative.embeds, mask=negative.mask))

    def denoise(self, request, encoding, size, timings, on_step, threshold):
        negative = None if encoding.negative is None else _qwen_text(encoding.negative)
        return self.inner.denoise(request, _qwen_text(encoding.positive), negative, timings, on_step)


class Flux2FamilyLoop(LoopAdapter):
    """FLUX.2 dev and Klein (one loop: the family decides embedded guidance or true CFG)."""

    def __init__(self, hub):
        self.inner = Flux2Loop(
            hub.runners, hub.family, hub.index, hub.denoiser_config, hub.scheduler_config,
            hub.tokenizers["tokenizer"], vae_scale_factor=hub.vae_scale_factor)

    def runs_cfg(self, request) -> bool:
        return self.inner.true_cfg(request)

    def encode(self, request) -> PromptEncoding:
        positive, negative = self.inner.encode(request)
        return PromptEncoding(_Conditioning(positive), None if negative is None else _Conditioning(negative))

    def denoise(self, request, encoding, size, timings, on_step, threshold):
        return self.inner.denoise(request, encoding.positive.embeds, negative_embeds(encoding), timings, on_step)


def _qwen_text(conditioning: _Conditioning) -> QwenText:
    return QwenText(conditioning.embeds, conditioning.mask)


def family_loop(hub) -> FamilyLoop:
    """The loop the hub's family declares (`FamilyInfo.loop`, imported on first use)."""
    locator = family_info(hub.family).loop
    if locator is None:
        raise InternalError(f"the {hub.family.value} family's declaration names no loop (FamilyInfo.loop)")
    module, _, name = locator.partition(":")
    return getattr(importlib.import_module(module), name)(hub)
