"""The UNet/SD3 loop (SD1.5, SDXL, SD3): tokenize → CLIP/T5 text encoders → scheduler loop (CFG batched, split or
parallel; ControlNet; DeepCache) → VAE decode, from noise (txt2img) or from an init image (img2img, inpaint:
runtime/conditioning.py), following diffusers' StableDiffusion(XL|3)Pipeline step for step so the torch-reference
runners reproduce diffusers' images exactly. What differs between the families it runs is their declaration's:
`text_encoding` (the hub's CLIP/T5 prompt encoding, SDXL's added `text_embeds`/`time_ids` and zeros for an empty
negative prompt), `denoiser` (a UNet's feeds or an MMDiT's) and `flow_matching` (the noise unscaled). Unlike the
other family loops it runs requests of one `batch_key` through shared denoiser calls (`batches_requests`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..engines_file.engine_spec import Size
from ..families import Component, family_info
from ..step_cache import PIECES, StepCacheMethod, deepcache_full_steps, schedule_label
from ..workflows import Workflow
from . import conditioning
from .cfg_parallel import at_once
from .engines import RunnerTable
from .family_loops import LoopAdapter
from .requests import GenerationRequest, PromptEncoding, StageTimings, StepCallback, _Conditioning
from .schedulers import make_scheduler

DEEP_FEATURE = "deep_feature"  # DeepCache's cached tensor (components/deepcache.py)


@dataclass
class _CachedCall:
    """One denoiser call of a step-cached schedule: `full` runs unet_deep and keeps its feature under `slot` (the
    call's place in the step: batched, cond or uncond), a cached step runs unet_shallow on it."""

    full: bool
    features: dict
    slot: str

    @property
    def component(self) -> str:
        deep, shallow = PIECES[StepCacheMethod.deepcache]
        return deep if self.full else shallow


@dataclass
class _Item:
    """One request's own state in a denoising batch: its generator, scheduler and latents."""

    request: GenerationRequest
    encoding: PromptEncoding
    generator: torch.Generator
    scheduler: object
    latents: torch.Tensor
    step_kwargs: dict
    start: conditioning.ImageStart | None = None  # img2img/inpaint: the trimmed schedule and the mask work

    @property
    def timesteps(self):
        return self.start.timesteps if self.start is not None else self.scheduler.timesteps

    @property
    def rows(self) -> int:
        return self.request.batch


def latent_device(runners: RunnerTable, denoiser: str, request: GenerationRequest) -> str | None:
    """"cuda" when every denoiser runner takes and gives torch CUDA tensors (`device_tensors`, the
    TensorRT runner) and torch has CUDA: the latents then stay on the GPU between steps. None (the
    host path, unchanged) otherwise, and with ControlNet residuals, which are computed on the host."""
    runners = [e.runner for e in runners.entries if e.component == denoiser]
    takes_device_tensors = runners and all(getattr(r, "device_tensors", False) for r in runners)
    if request.controlnet is not None or not takes_device_tensors or request.init_image is not None:
        return None
    if any("mid_block_residual" in r.inputs for r in runners) or not torch.cuda.is_available():
        return None
    return "cuda"


class UnetLoop:
    """The UNet/SD3 denoising loop of an EnginePipeline: what it reads of the model folder, and its runners. The
    hub's CLIP/T5 prompt encoding (`encode_all`), its CFG mode per size and rows (`cfg_mode`) and its DeepCache
    interval per request (`cache_interval`) come from the hub, as FLUX.1's encoding does."""

    def __init__(self, hub):
        self.runners, self.family, self.index = hub.runners, hub.family, hub.index
        self.scheduler_config, self.denoiser_config = hub.scheduler_config, hub.denoiser_config
        self.vae_scale_factor, self.latent_channels = hub.vae_scale_factor, hub.latent_channels
        self.scaling_factor, self.shift_factor = hub.scaling_factor, hub.shift_factor
        self.denoiser = hub.denoiser
        info = family_info(self.family)
        self.text_encoding, self.flow_matching = info.text_encoding, info.flow_matching
        self._encode_all: Callable = hub._encode_all
        self._cfg_mode: Callable = hub._cfg_mode
        self.cache_interval: Callable = hub.cache_interval

    def encode(self, request: GenerationRequest) -> PromptEncoding:
        """Text encoders for the prompt (and the negative prompt where CFG runs)."""
        positive = self._encode_all([request.prompt] * request.batch)
        negative = None
        if request.guidance_scale > 1.0:
            negative = self.negative(request, positive, request.batch)
        return PromptEncoding(positive, negative)

    def negative(self, request: GenerationRequest, positive: _Conditioning, batch: int) -> _Conditioning:
        zeros_for_empty = (self.text_encoding is not None and self.text_encoding.zeros_for_empty_negative
                           and self.index.get("force_zeros_for_empty_prompt", True))
        if request.negative_prompt is None and zeros_for_empty:
            pooled = None if positive.pooled is None else np.zeros_like(positive.pooled)
            return _Conditioning(np.zeros_like(positive.embeds), pooled)
        return self._encode_all([request.negative_prompt or ""] * batch)

    def item(self, request: GenerationRequest, encoding: PromptEncoding, size: Size) -> _Item:
        """A request's seeded noise and its own scheduler, set up as diffusers does."""
        generator = torch.Generator().manual_seed(int(request.seed))
        scheduler = make_scheduler(request.scheduler, self.scheduler_config, self.family.value)
        h, w = size.latent(self.vae_scale_factor)
        workflow = request.resolved_workflow
        if workflow in (Workflow.img2img, Workflow.inpaint):
            return self._image_item(request, encoding, size, workflow, generator, scheduler)
        channels = self.denoiser_config["in_channels"]
        latents = torch.randn((request.batch, channels, h, w), generator=generator, dtype=torch.float32)
        device = latent_device(self.runners, self.denoiser, request)  # None: the host path, numpy between runner and scheduler
        if device is None:
            scheduler.set_timesteps(request.steps)
        else:  # same seeded noise, drawn on the host; steps and guidance then run where the engine's outputs are
            latents = latents.to(device)
            scheduler.set_timesteps(request.steps, device=device)
        if not self.flow_matching:  # flow matching starts from the unscaled noise
            latents = latents * scheduler.init_noise_sigma
        return _Item(request, encoding, generator, scheduler, latents, _step_kwargs(scheduler, generator))

    def _image_item(self, request, encoding, size, workflow, generator, scheduler) -> _Item:
        """An img2img/inpaint request: the schedule trimmed by strength, start latents from the init image
        (host path: the latents stay on the host)."""
        scheduler.set_timesteps(request.steps)
        h, w = size.latent(self.vae_scale_factor)
        encoder = conditioning.LatentEncoder(self.runners.find("vae_encoder", size=size, batch=1), self.family,
                                             self.scaling_factor, self.shift_factor)
        start_request = _StartRequest(request.steps, request.resolved_strength, request.init_image, request.mask)
        latents, start = conditioning.image_start(
            workflow, request=start_request, scheduler=scheduler, generator=generator, encoder=encoder,
            family=self.family, shape=(request.batch, self.latent_channels, h, w),
            denoiser_channels=self.denoiser_config["in_channels"],
            init_noise_sigma=getattr(scheduler, "init_noise_sigma", 1.0))  # flow matching has none
        return _Item(request, encoding, generator, scheduler, latents, _step_kwargs(scheduler, generator), start)

    def denoise_items(self, items: list[_Item], size: Size, timings: StageTimings,
                       on_step: StepCallback | None = None) -> tuple[list[torch.Tensor], str]:
        """The scheduler loop for requests of one batch_key (UNet families, SD3): one denoiser call per step (two
        with split CFG) over every request's rows; guidance and scheduler steps per request, on its own rows."""
        first = items[0].request
        rows = sum(item.rows for item in items)
        do_cfg = items[0].encoding.negative is not None
        cfg_mode = self._cfg_mode(size, rows) if do_cfg else "none"
        positive = _cat_all([item.encoding.positive for item in items])
        negative = _cat_all([item.encoding.negative for item in items]) if do_cfg else None
        control = None
        if first.controlnet:
            control = np.concatenate([self._control_image(item.request, item.rows) for item in items])
        extra = self._added_conditioning(size, rows)
        offsets = np.cumsum([0] + [item.rows for item in items])
        timesteps = items[0].timesteps
        interval = self.cache_interval(first)
        full_steps = deepcache_full_steps(len(timesteps), interval) if interval else None
        timings.step_schedule = schedule_label(full_steps) if full_steps else ""
        features: dict[str, object] = {}  # each call's deep feature from its last full step (CFG split: two)
        for index, t in enumerate(timesteps):
            start = time.perf_counter()
            scaled = [_denoiser_input(item, _scale_input(item.scheduler, item.latents, t)) for item in items]

            def cached(slot: str) -> _CachedCall | None:
                return None if full_steps is None else _CachedCall(full_steps[index], features, slot)

            if cfg_mode == "batched":
                model_in = torch.cat(scaled * 2)
                noise = self._denoise(model_in, t, _cat(negative, positive), _cat_extra(extra), size, first,
                                      None if control is None else np.concatenate([control] * 2),
                                      cached=cached("batched"))
                uncond, cond = noise.chunk(2) if isinstance(noise, torch.Tensor) else np.split(noise, 2)
            elif cfg_mode == "split":
                model_in = torch.cat(scaled)
                uncond = self._denoise(model_in, t, negative, extra, size, first, control, cached=cached("uncond"))
                cond = self._denoise(model_in, t, positive, extra, size, first, control, cached=cached("cond"))
            elif cfg_mode == "parallel":  # split's two calls at once, each on its own instance: split's outputs
                model_in = torch.cat(scaled)
                uncond, cond = at_once(partial(self._denoise, model_in, t, negative, extra, size, first, control,
                                               cached=cached("uncond")),
                                       partial(self._denoise, model_in, t, positive, extra, size, first, control,
                                               instance=1, cached=cached("cond")))
            else:
                model_in = torch.cat(scaled)
                cond = self._denoise(model_in, t, positive, extra, size, first, control, cached=cached("cond"))
                uncond = None
            for item, lo, hi in zip(items, offsets[:-1], offsets[1:]):
                noise_pred = _as_torch(cond[lo:hi] if len(items) > 1 else cond)
                if uncond is not None:
                    uncond_t = _as_torch(uncond[lo:hi] if len(items) > 1 else uncond)
                    noise_pred = uncond_t + item.request.guidance_scale * (noise_pred - uncond_t)
                item.latents = item.scheduler.step(noise_pred, t, item.latents, **item.step_kwargs,
                                                   return_dict=False)[0]
                if item.start is not None and item.start.blend:
                    item.latents = conditioning.blend_known_region(item.start, item.scheduler, self.family,
                                                                   item.latents, index)
            timings.step_s.append(time.perf_counter() - start)
            if on_step is not None:
                on_step(index, len(timesteps), [item.latents.cpu() for item in items])
        return [item.latents.cpu() for item in items], cfg_mode  # .cpu() is a no-op on the host path

    def _added_conditioning(self, size: Size, batch: int) -> dict[str, np.ndarray]:
        if self.text_encoding is None or not self.text_encoding.text_time:
            return {}
        # original size, crop top-left, target size: diffusers' defaults for text-to-image
        time_ids = np.array([[size.height, size.width, 0, 0, size.height, size.width]] * batch, np.float32)
        return {"time_ids": time_ids}

    def _denoise(self, model_in, t, cond: _Conditioning, extra, size, request, control, instance: int = 0,
                 cached: _CachedCall | None = None) -> np.ndarray:
        """One denoiser call (its ControlNet's first); `instance`: which runner over the engine (cfg parallel's
        second call runs on the second, so the two run at once); `cached`: a step-cached call (DeepCache: the full
        UNet keeping its deep feature, or the shallow path on the kept one) instead of the uncached engine."""
        # on the device path the sample stays a torch CUDA tensor and the runner gives one back
        sample = model_in.numpy().astype(np.float32) if not model_in.is_cuda else model_in.float().contiguous()
        batch = sample.shape[0]
        timestep = np.full((batch,), float(t), np.float32)
        if self.denoiser == Component.transformer:  # an MMDiT (SD3)
            feeds = {"hidden_states": sample, "timestep": timestep, "encoder_hidden_states": cond.embeds,
                     "pooled_projections": cond.pooled}
        else:
            feeds = {"sample": sample, "timestep": timestep, "encoder_hidden_states": cond.embeds}
            if self.text_encoding is not None and self.text_encoding.text_time:  # SDXL's added conditioning
                feeds["text_embeds"] = cond.pooled
                feeds["time_ids"] = extra["time_ids"]
        component = self.denoiser if cached is None else cached.component
        runner = self.runners.find(component, size=size, batch=batch, instance=instance)
        needed = set(runner.inputs)
        if control is not None or "mid_block_residual" in needed or any("down_block_residual" in n for n in needed):
            feeds.update(self._residuals(feeds, runner, size, request, control, instance))
        if cached is not None and not cached.full:
            feeds[DEEP_FEATURE] = cached.features[cached.slot]
        # arrays keep their memory layout: img2img latents inherit the init image's channels-last strides, as in
        # diffusers, and the torch reference must see them so (engine runners copy to contiguous where needed)
        outputs = runner.run(feeds)
        if cached is not None and cached.full:
            cached.features[cached.slot] = outputs[DEEP_FEATURE]
        return outputs["noise_pred"]

    def _residuals(self, unet_feeds, unet_runner, size, request, control, instance: int = 0
                   ) -> dict[str, np.ndarray]:
        names = [n for n in unet_runner.inputs if "residual" in n]
        if control is None:  # an engine with ControlNet inputs, used without one: zero residuals
            return {n: np.zeros(self._residual_shape(n, unet_runner, unet_feeds["sample"]), np.float32) for n in names}
        batch = unet_feeds["sample"].shape[0]
        runner = self.runners.find("controlnet", size=size, batch=batch, controlnet=request.controlnet,
                                   instance=instance)
        feeds = {k: v for k, v in unet_feeds.items() if k in runner.inputs}
        # an inpainting UNet's mask and masked-image channels are its own: the ControlNet sees the latents
        if feeds["sample"].shape[1] > self.latent_channels:
            feeds["sample"] = feeds["sample"][:, :self.latent_channels]
        feeds["controlnet_cond"] = control
        feeds["conditioning_scale"] = np.array([request.controlnet_scale], np.float32)
        outputs = runner.run(feeds)
        return {n: outputs[n] for n in names}

    def _residual_shape(self, name, runner, sample) -> tuple[int, ...]:
        shape = runner.inputs[name].shape
        if all(isinstance(d, int) for d in shape):
            return tuple(shape)
        # dynamic engine: derive from the UNet config (channels per block, downsampled per level)
        return _unet_residual_shapes(self.denoiser_config, sample.shape)[name]

    def _control_image(self, request, batch) -> np.ndarray:
        image = request.control_image.astype(np.float32) / 255.0  # [0, 1], as diffusers' ControlNet pipelines
        image = np.transpose(image, (2, 0, 1))[None]
        return np.ascontiguousarray(np.repeat(image, batch, axis=0))


class UnetFamilyLoop(LoopAdapter):
    """SD1.5, SDXL and SD3: UnetLoop, the hub's VAE decode, and requests of one batch_key denoised together."""

    batches_requests = True

    def __init__(self, hub):
        self.inner = UnetLoop(hub)
        self._decode_vae: Callable = hub._decode_vae

    def encode(self, request) -> PromptEncoding:
        return self.inner.encode(request)

    def denoise(self, request, encoding, size, timings, on_step, threshold):
        latents, cfg_mode = self.inner.denoise_items([self.inner.item(request, encoding, size)], size, timings,
                                                     on_step)
        return latents[0], cfg_mode

    def denoise_together(self, requests, encodings, size, timings, on_step):
        """Requests of one batch_key through one denoiser call per step: (each one's final latents, cfg mode)."""
        items = [self.inner.item(request, encoding, size) for request, encoding in zip(requests, encodings)]
        return self.inner.denoise_items(items, size, timings, on_step)

    def decode(self, latents, size, batch):
        return self._decode_vae(latents, size, batch)


@dataclass(frozen=True)
class _StartRequest:
    """What conditioning.image_start reads of a request."""

    steps: int
    strength: float
    init_image: np.ndarray
    mask: np.ndarray | None


def _denoiser_input(item: _Item, scaled: torch.Tensor) -> torch.Tensor:
    """The scaled latents, with the mask and masked-image channels where an inpainting denoiser takes them."""
    if item.start is not None and item.start.masked_image_latents is not None and not item.start.blend:
        return conditioning.inpaint_channels(item.start, scaled)
    return scaled


def _as_torch(value) -> torch.Tensor:
    """A runner's output as a torch tensor: numpy shares its memory (the host path), a tensor stays."""
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(value)


def _scale_input(scheduler, sample: torch.Tensor, t) -> torch.Tensor:
    """Flow-matching schedulers feed the latents unscaled."""
    scale = getattr(type(scheduler), "scale_model_input", None)
    return scale(scheduler, sample, t) if scale else sample


def _step_kwargs(scheduler, generator) -> dict:
    import inspect

    accepted = set(inspect.signature(scheduler.step).parameters)
    kwargs = {}
    if "eta" in accepted:
        kwargs["eta"] = 0.0
    if "generator" in accepted:
        kwargs["generator"] = generator
    return kwargs


def _cat(negative: _Conditioning, positive: _Conditioning) -> _Conditioning:
    pooled = None if positive.pooled is None else np.concatenate([negative.pooled, positive.pooled])
    return _Conditioning(np.concatenate([negative.embeds, positive.embeds]), pooled)


def _cat_all(parts: list[_Conditioning]) -> _Conditioning:
    if len(parts) == 1:
        return parts[0]
    pooled = None if parts[0].pooled is None else np.concatenate([p.pooled for p in parts])
    return _Conditioning(np.concatenate([p.embeds for p in parts]), pooled)


def _cat_extra(extra: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([v, v]) for k, v in extra.items()}


def _unet_residual_shapes(config: dict, sample_shape) -> dict[str, tuple[int, ...]]:
    """The ControlNet residual shapes a UNet expects, following its down blocks."""
    batch, _, h, w = sample_shape
    channels = config["block_out_channels"]
    layers = config["layers_per_block"]
    shapes = [(batch, channels[0], h, w)]
    for i, out_ch in enumerate(channels):
        for _ in range(layers):
            shapes.append((batch, out_ch, h, w))
        if i < len(channels) - 1:
            h, w = (h + 1) // 2, (w + 1) // 2
            shapes.append((batch, out_ch, h, w))
    result = {f"down_block_residual_{i}": s for i, s in enumerate(shapes)}
    result["mid_block_residual"] = (batch, channels[-1], h, w)
    return result
