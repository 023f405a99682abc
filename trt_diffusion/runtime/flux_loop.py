"""The FLUX loop over runners: packed latents, the sigma schedule shifted by the image's token count, and the
image-conditioned workflows as diffusers' FLUX pipelines run them, draw for draw from the request's generator.

| workflow | diffusers | generator draws | what the transformer sees |
|---|---|---|---|
| txt2img | FluxPipeline | noise | the noise tokens |
| img2img | FluxImg2ImgPipeline | init latent, noise | the init image noised to the first kept sigma |
| inpaint, plain transformer | FluxInpaintPipeline | init latent, noise (a masked latent, unused) | as img2img; the known region blended back after each step |
| inpaint, Fill transformer | FluxFillPipeline | init latent, noise, masked latent | latents ‖ masked-image latents ‖ the mask per 8x8 pixels, on channels |
| edit (Kontext) | FluxKontextPipeline | noise (the init latent is its mean: no draw) | noise tokens ‖ init-image tokens (image ids with 1 in front), output cut to the noise tokens |

Strength trims the schedule's head as SD3's img2img does (the float product of steps and strength); the shift `mu`
always follows the noise tokens alone (the Kontext context tokens do not enter it).

True CFG (FluxPipeline's `true_cfg_scale`) runs for a transformer without a guidance embedding (FLUX.1-schnell's
layout, the DiT micro-model) when the request has a NEGATIVE_PROMPT (`""` counts) and GUIDANCE_SCALE > 1, which is
then the true CFG scale: per step the prompt's call, then the negative prompt's, each over the request's rows, and
negative + scale * (positive - negative), as diffusers' do_true_cfg. A guidance-embedding transformer (FLUX.1-dev)
takes GUIDANCE_SCALE as its embedding and runs one call per step.

Requests are not batched with each other: without true CFG a one-image request calls the transformer over one row, and its timestep and guidance embedders' linear layers round differently over one row (a matrix-vector
product) than over several; a batched request would not equal its own image.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..engines_file.engine_spec import Size
from ..errors import RuntimeInputError
from ..families import Family
from ..step_cache import PIECES, StepCacheMethod, first_block_skips
from ..workflows import Workflow
from . import conditioning
from .requests import Conditioning, GenerationRequest, StageTimings, StepCallback
from .schedulers import make_scheduler

PACKING = 2  # FLUX packs 2x2 latent pixels into one token


@dataclass
class FluxItem:
    """One request's state in the FLUX loop. Tensors are packed [rows, tokens, channels]."""

    request: GenerationRequest
    positive: Conditioning
    scheduler: object
    latents: torch.Tensor
    timesteps: torch.Tensor
    blend: conditioning.ImageStart | None = None  # plain-transformer inpaint: image latents, noise, mask (packed)
    fill: torch.Tensor | None = None  # Fill: masked-image latents ‖ mask, joined to the latents on channels
    context: torch.Tensor | None = None  # Kontext: the init image's tokens, joined to the latents on tokens
    negative: Conditioning | None = None  # true CFG's negative prompt (None: one call per step)

    @property
    def rows(self) -> int:
        return self.request.batch

    def model_input(self) -> torch.Tensor:
        if self.fill is not None:
            return torch.cat((self.latents, self.fill), dim=2)
        if self.context is not None:
            return torch.cat([self.latents, self.context], dim=1)
        return self.latents


class FluxLoop:
    """The FLUX denoising loop of an EnginePipeline: what it reads of the model folder, and its runners."""

    def __init__(self, runners, denoiser_config: dict, scheduler_config: dict, *, latent_channels: int,
                 vae_scale_factor: int, scaling_factor: float, shift_factor: float, denoiser: str = "transformer",
                 family: Family | str):
        self.runners, self.denoiser, self.family = runners, denoiser, Family(family)
        self.config, self.scheduler_config = denoiser_config, scheduler_config
        self.latent_channels, self.vae_scale_factor = latent_channels, vae_scale_factor
        self.scaling_factor, self.shift_factor = scaling_factor, shift_factor
        self.packed_channels = latent_channels * PACKING * PACKING
        # FluxFillPipeline: latents, the masked image's latents and the mask (one channel per pixel of a
        # vae_scale_factor^2 patch, packed 2x2) side by side
        self.fill_channels = 2 * self.packed_channels + PACKING * PACKING * vae_scale_factor ** 2
        # the blocks' width (first-block caching's residuals)
        self.inner_dim = int(denoiser_config["num_attention_heads"]) * int(denoiser_config["attention_head_dim"])
        self.embedded_guidance = bool(denoiser_config.get("guidance_embeds", False))  # diffusers' default

    def true_cfg(self, request: GenerationRequest) -> bool:
        """FluxPipeline's do_true_cfg with GUIDANCE_SCALE as true_cfg_scale, for a transformer that embeds no
        guidance (one that does takes GUIDANCE_SCALE as its embedding: FLUX.1-dev's usage)."""
        return not self.embedded_guidance and request.guidance_scale > 1.0 and request.negative_prompt is not None

    @property
    def fill_transformer(self) -> bool:
        return int(self.config["in_channels"]) == self.fill_channels

    # ---------------------------------------------------------------- items

    def item(self, request: GenerationRequest, positive: Conditioning, size: Size,
             negative: Conditioning | None = None) -> FluxItem:
        """A request's seeded start, its own scheduler and schedule, set up as its diffusers pipeline does;
        `negative`: true CFG's negative prompt (true_cfg)."""
        generator = torch.Generator().manual_seed(int(request.seed))
        scheduler = make_scheduler(request.scheduler, self.scheduler_config, self.family.value)
        rows = request.batch
        h, w = self.latent_size(size)
        shape = (rows, self.latent_channels, h, w)
        self._set_schedule(scheduler, request.steps, (h // PACKING) * (w // PACKING))
        workflow = request.resolved_workflow
        item = FluxItem(request, positive, scheduler, latents=torch.empty(0), timesteps=scheduler.timesteps,
                        negative=negative)
        if workflow is Workflow.txt2img:
            item.latents = self.pack(torch.randn(shape, generator=generator, dtype=torch.float32))
            return item
        image = conditioning.image_tensor(request.init_image)  # channels-last, as VaeImageProcessor gives it
        encoder = conditioning.LatentEncoder(self.runners.find("vae_encoder", size=size, batch=1), self.family,
                                             self.scaling_factor, self.shift_factor)
        if workflow is Workflow.edit:  # FluxKontextPipeline: the full schedule, the image beside the noise
            item.context = self.pack(conditioning.repeat_rows(encoder.mode(image), rows))  # the latent's mean: no draw
            item.latents = self.pack(torch.randn(shape, generator=generator, dtype=torch.float32))
            scheduler.set_begin_index(0)
            return item
        item.timesteps = conditioning.trim_timesteps(scheduler, request.steps, request.resolved_strength,
                                                     self.family)
        # encoded at every strength, 1 included
        image_latents, noise, latents = conditioning.noised_image(encoder, image, generator, scheduler,
                                                                  item.timesteps, rows)
        item.latents = self.pack(latents)
        if workflow is Workflow.img2img:
            return item
        mask = conditioning.mask_tensor(request.mask)
        if self.fill_transformer:
            masked_latents = self.pack(conditioning.repeat_rows(encoder.encode(image * (1 - mask), generator), rows))
            item.fill = torch.cat((masked_latents, self._fill_mask(conditioning.repeat_rows(mask, rows), h, w)), dim=-1)
        elif int(self.config["in_channels"]) == self.packed_channels:
            # FluxInpaintPipeline encodes the masked image too, then never uses it with a plain transformer: that
            # draw is the request's last, so leaving it out changes nothing
            item.blend = conditioning.packed_blend(item.timesteps, image_latents, noise, mask, self.pack)
        else:
            raise RuntimeInputError(
                f"an inpainting FLUX transformer takes {self.packed_channels} input channels (mask blending) or "
                f"{self.fill_channels} (FLUX.1 Fill), this one {self.config['in_channels']}")
        return item

    def latent_size(self, size: Size) -> tuple[int, int]:
        factor = self.vae_scale_factor * PACKING
        return PACKING * (size.height // factor), PACKING * (size.width // factor)

    def _set_schedule(self, scheduler, steps: int, tokens: int) -> None:
        """FLUX's sigmas (1 → 1/steps), shifted by `mu` from the noise's token count where the scheduler shifts."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = scheduler.config
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        kwargs = {"mu": mu} if config.get("use_dynamic_shifting") else {}
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), **kwargs)

    def _fill_mask(self, mask: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[rows, 1, H, W] pixels -> packed [rows, tokens, 4 * vae_scale_factor^2]: each latent pixel's patch of
        the mask as channels (FluxFillPipeline.prepare_mask_latents)."""
        rows, factor = mask.shape[0], self.vae_scale_factor
        mask = mask[:, 0, :, :].view(rows, h, factor, w, factor).permute(0, 2, 4, 1, 3)
        return self.pack(mask.reshape(rows, factor * factor, h, w))

    # ---------------------------------------------------------------- the loop

    def denoise(self, item: FluxItem, size: Size, timings: StageTimings,
                on_step: StepCallback | None = None, threshold: float | None = None) -> torch.Tensor:
        """The request's final latents, unpacked [rows, C, h, w]: one transformer call per step (two with true
        CFG); with `threshold` (first-block caching) the first block every step and the rest only where its residual
        moved more."""
        h, w = self.latent_size(size)
        tokens = (h // PACKING) * (w // PACKING)
        image_ids = _image_ids(h // PACKING, w // PACKING)
        if item.context is not None:  # the context tokens' ids: the same grid with 1 in front
            context_ids = image_ids.clone()
            context_ids[..., 0] = 1
            image_ids = torch.cat([image_ids, context_ids], dim=0)
        runner = self._runner(size, item.rows, len(image_ids), item.request.resolved_workflow)
        texts = [item.positive] if item.negative is None else [item.positive, item.negative]
        constants = [self._text_feeds(text, image_ids, runner, item) for text in texts]
        # first-block caching keeps one state per call, as diffusers' cache_context("cond") / ("uncond")
        caches = [None if threshold is None else _FirstBlockCache(self.runners, size, item.rows, threshold,
                                                                   len(image_ids), self.inner_dim) for _ in texts]
        for index, t in enumerate(item.timesteps):
            start = time.perf_counter()
            step_feeds = {"hidden_states": item.model_input().numpy(),
                          "timestep": np.full((item.rows,), float(t) / 1000, np.float32)}
            predictions = []
            for constant, cache in zip(constants, caches, strict=True):
                feeds = {**step_feeds, **constant}
                if cache is None:
                    predictions.append(torch.from_numpy(runner.run(feeds)["noise_pred"]))
                else:
                    predictions.append(torch.from_numpy(cache.step(feeds)))
            if caches[0] is not None:
                timings.step_schedule = caches[0].label  # the prompt's call's schedule
            noise_pred = predictions[0]
            if item.negative is not None:  # FluxPipeline's true CFG, in its order of operations
                noise_pred = predictions[1] + item.request.guidance_scale * (noise_pred - predictions[1])
            if item.context is not None:
                noise_pred = noise_pred[:, :tokens]  # the noise tokens' prediction; the context's is dropped
            item.latents = item.scheduler.step(noise_pred, t, item.latents, return_dict=False)[0]
            if item.blend is not None:
                item.latents = conditioning.blend_known_region(item.blend, item.scheduler, self.family,
                                                               item.latents, index)
            timings.step_s.append(time.perf_counter() - start)
            if on_step is not None:
                on_step(index, len(item.timesteps), [item.latents])
        return self.unpack(item.latents, size)

    @staticmethod
    def _text_feeds(text: Conditioning, image_ids: torch.Tensor, runner, item: FluxItem) -> dict:
        """The transformer's inputs that stay the same for every step of one prompt's calls."""
        feeds = {"encoder_hidden_states": text.embeds, "pooled_projections": text.pooled,
                 "img_ids": image_ids.numpy(), "txt_ids": np.zeros((text.embeds.shape[1], 3), np.float32)}
        if "guidance" in runner.inputs:
            feeds["guidance"] = np.full((item.rows,), item.request.guidance_scale, np.float32)
        return feeds

    def _runner(self, size: Size, rows: int, sequence: int, workflow: Workflow):
        """The transformer runner for `rows` over `sequence` image tokens (edit: twice the image's)."""
        runner = self.runners.find(self.denoiser, size=size, batch=rows)
        spec = runner.inputs.get("hidden_states")
        fixed = spec.shape[1] if spec is not None and len(spec.shape) == 3 else None
        if isinstance(fixed, int) and fixed != sequence:
            why = (" (the noise's tokens and the init image's: build the edit model's transformer with a profile "
                   "for twice the image tokens)" if workflow is Workflow.edit else "")
            raise RuntimeInputError(f"the {workflow.value} workflow at {size} feeds the transformer {sequence} "
                                    f"image tokens{why}; {runner.name} takes {fixed}")
        return runner

    # ---------------------------------------------------------------- packing

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        from diffusers import FluxPipeline

        rows, channels, h, w = latents.shape
        return FluxPipeline._pack_latents(latents, rows, channels, h, w)

    def unpack(self, latents: torch.Tensor, size: Size) -> torch.Tensor:
        from diffusers import FluxPipeline

        return FluxPipeline._unpack_latents(latents, size.height, size.width, self.vae_scale_factor)


class _FirstBlockCache:
    """One request's first-block cache (step_cache.py): the first block's residual of the last full step and the
    remaining blocks' residual from it, as diffusers' FirstBlockCacheConfig hook keeps them."""

    def __init__(self, runners, size: Size, rows: int, threshold: float, tokens: int, width: int):
        first, rest = PIECES[StepCacheMethod.first_block]
        self.first = runners.find(first, size=size, batch=rows)
        self.rest = runners.find(rest, size=size, batch=rows)
        self.threshold = threshold
        self.previous = self.tail = None
        self.zero_tail = np.zeros((rows, tokens, width), np.float32)  # the first step's (its cached output unused)
        self.label = ""

    def step(self, feeds: dict) -> np.ndarray:
        tail = self.zero_tail if self.tail is None else self.tail
        out = self.first.run({**{k: v for k, v in feeds.items() if k in self.first.inputs}, "tail_residual": tail})
        if self.tail is not None and first_block_skips(out["first_residual"], self.previous, self.threshold):
            self.label += "c"
            return out["cached_noise_pred"]
        rest_feeds = {k: v for k, v in feeds.items() if k in self.rest.inputs}
        rest = self.rest.run({**rest_feeds, "first_hidden": out["first_hidden"], "first_encoder": out["first_encoder"]})
        self.previous, self.tail = out["first_residual"], rest["tail_residual"]
        self.label += "F"
        return rest["noise_pred"]


def _image_ids(rows: int, cols: int) -> torch.Tensor:
    from diffusers import FluxPipeline

    return FluxPipeline._prepare_latent_image_ids(1, rows, cols, "cpu", torch.float32)

