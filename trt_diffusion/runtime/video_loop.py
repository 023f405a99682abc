"""The Wan 2.x text-to-video loop over runners, step for step as diffusers' `WanPipeline` runs it, so the torch
reference runners reproduce its videos bit for bit:

- prompt: diffusers' own `prompt_clean` (ftfy where installed, html unescaped twice, whitespace collapsed), padded
  to the text encoder's length; UMT5's raw last hidden state comes back from the runner and is zeroed past the
  prompt's tokens on the host. One encoder call per prompt (the negative one too, "" by default), repeated to
  num_videos_per_prompt rows, as diffusers does (a batch-N call need not round as batch 1 does).
- noise: randn [rows, 16, (F - 1) / 4 + 1, H / 8, W / 8] from the request's generator, its only draw.
- CFG (guidance_scale > 1): a conditional then an unconditional call per step over the request's rows (`split`);
  `batched`, both halves in one call, only where the engines offer batch 2·rows alone, and then not bit-exact;
  `parallel` (declared in engines.yaml, never guessed): split's two calls at once on two instances of the expert,
  so split's video bit for bit in less wall time where there are cores or devices for both (runtime/cfg_parallel.py).
- Wan 2.2's two experts: boundary = boundary_ratio × num_train_timesteps; t >= boundary runs `transformer` with
  guidance_scale, below it `transformer_2` with guidance_scale_2 (default guidance_scale).
- image-to-video (img2vid, an I2V checkpoint: WanImageToVideoPipeline): the noise has the VAE's z_dim channels,
  the first-frame mask and the image's clip latents are concatenated to it at every call, and Wan 2.1 I2V's
  transformer also gets the CLIP image embeds (runtime/video_conditioning.py says how each is made).
- decode: latents / (1 / latents_std) + latents_mean in torch as diffusers writes it, the vae_decoder runner, then
  the image families' uint8 conversion (VideoProcessor's, per frame; pipeline.py) → [rows, F, H, W, 3].

Requests are not batched with each other (EnginePipeline.batch_key): WanPipeline calls its transformer over one
request's rows, and linear layers round differently over more rows, so a shared call would not give the video the
request gets alone.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..engines_file.engine_spec import Size
from ..errors import RuntimeInputError
from ..families import FAMILIES, WAN_TEXT_LENGTH, Family, family_info
from ..workflows import IMAGE_TO_VIDEO_PIPELINE_CLASSES
from .cfg_parallel import at_once
from .requests import GenerationRequest, StageTimings, StepCallback
from .schedulers import make_scheduler
from .video_conditioning import ImageConditioner

EXPERTS = ("transformer", "transformer_2")  # Wan 2.2: the high-noise expert, then the low-noise one


def video_problems(family: Family, request: GenerationRequest, loop: WanLoop | None) -> list[str]:
    """What is wrong with a request's video fields (FRAMES, GUIDANCE_SCALE_2) for this family and model."""
    factor = family_info(family).temporal_factor
    frames = request.frames
    problems = []
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)):
        problems.append(f"FRAMES must be a whole number, got {frames!r}")
    elif not factor and frames != 0:
        videos = ", ".join(f.value for f, info in FAMILIES.items() if info.is_video)
        problems.append(f"FRAMES {frames}: the {family.value} family makes images (FRAMES is 0 for an image; video "
                        f"families: {videos})")
    elif factor and (frames < 1 or (frames - 1) % factor):
        below = max((frames - 1) // factor, 0) * factor + 1
        hint = f": use {below} or {below + factor}" if frames > 1 else ""
        problems.append(f"FRAMES must be {factor}k+1 for the {family.value} family (its VAE packs {factor} frames "
                        f"into each latent frame after the first), got {frames}{hint}")
    if request.guidance_scale_2 is not None:
        if loop is None or loop.boundary_ratio is None:
            problems.append("GUIDANCE_SCALE_2 is the low-noise expert's guidance of a two-expert (Wan 2.2) model; "
                            "this model has one denoiser (no boundary_ratio in its model_index.json)")
        elif not np.isfinite(request.guidance_scale_2) or not 0 <= request.guidance_scale_2 <= 100:
            problems.append(f"GUIDANCE_SCALE_2 must be in [0, 100], got {request.guidance_scale_2}")
    if loop is not None and loop.boundary_ratio is not None and not loop.runners.has(EXPERTS[1]):
        problems.append(f"this two-expert model switches to {EXPERTS[1]} below timestep {loop.boundary_timestep:g} "
                        f"(boundary_ratio {loop.boundary_ratio}), but no {EXPERTS[1]} runner is served")
    return problems


class WanLoop:
    """The Wan denoising loop of an EnginePipeline: what it reads of the model folder, and its runners."""

    def __init__(self, runners, index: dict, denoiser_config: dict, scheduler_config: dict, vae_config: dict,
                 tokenizer, *, vae_scale_factor: int, parallel_cfg: bool = False, model_dir: Path | None = None,
                 family: Family | str):
        self.runners, self.tokenizer, self.family = runners, tokenizer, Family(family)
        self.parallel_cfg = parallel_cfg  # engines.yaml declares cfg: parallel (EnginePipeline's `cfg`)
        self.scheduler_config = scheduler_config
        self.image_to_video = index.get("_class_name") in IMAGE_TO_VIDEO_PIPELINE_CLASSES
        # num_channels_latents: WanPipeline's is the transformer's in_channels, WanImageToVideoPipeline's the VAE's
        # z_dim (the transformer's other 20 channels are the condition)
        self.channels = int(vae_config["z_dim"] if self.image_to_video else denoiser_config["in_channels"])
        self.vae_scale_factor = vae_scale_factor
        self.temporal_factor = int(vae_config.get("scale_factor_temporal", family_info(self.family).temporal_factor))
        z_dim = int(vae_config["z_dim"])
        # as WanPipeline builds them: float32 tensors, the std inverted once and divided by at decode
        self.latents_mean = torch.tensor(vae_config["latents_mean"]).view(1, z_dim, 1, 1, 1)
        self.latents_std = 1.0 / torch.tensor(vae_config["latents_std"]).view(1, z_dim, 1, 1, 1)
        self.boundary_ratio = index.get("boundary_ratio")  # None: Wan 2.1, one transformer
        self.boundary_timestep = (None if self.boundary_ratio is None else
                                  self.boundary_ratio * scheduler_config.get("num_train_timesteps", 1000))
        self.image = None if not self.image_to_video else ImageConditioner(
            model_dir, index, denoiser_config, vae_config, latents_mean=self.latents_mean,
            latents_std=self.latents_std, temporal_factor=self.temporal_factor)

    # ---------------------------------------------------------------- text

    def encode(self, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray | None]:
        """(positive, negative) UMT5 states [rows, S, D]; negative None where CFG does not run. WanPipeline's
        negative prompt defaults to "" (not zeros)."""
        positive = self._states(request.prompt, request.batch)
        negative = None
        if request.guidance_scale > 1.0:  # WanPipeline.do_classifier_free_guidance: guidance_scale alone decides
            negative = self._states(request.negative_prompt or "", request.batch)
        return positive, negative

    def _states(self, prompt: str, rows: int) -> np.ndarray:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean  # diffusers' own cleaning, ftfy included

        runner = self.runners.find("text_encoder", size=None, batch=1)
        length = runner.inputs["input_ids"].shape[1]
        length = length if isinstance(length, int) else WAN_TEXT_LENGTH  # the engine's padded length decides
        tokens = self.tokenizer([prompt_clean(prompt)], padding="max_length", max_length=length, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="np")
        mask = tokens.attention_mask.astype(np.int64)
        states = runner.run({"input_ids": tokens.input_ids.astype(np.int64), "attention_mask": mask})["hidden_states"]
        # `u[:seq_len]` then zeros, as _get_t5_prompt_embeds: np.where writes +0.0 (a mask multiply could give -0.0)
        kept = np.arange(states.shape[1])[None, :] < (mask > 0).sum(axis=1)[:, None]
        states = np.where(kept[..., None], states, np.float32(0.0))
        return np.repeat(states, rows, axis=0)  # prompt_embeds.repeat(1, n, 1).view(n, S, D): the same rows

    # ---------------------------------------------------------------- the loop

    def denoise(self, request: GenerationRequest, positive: np.ndarray, negative: np.ndarray | None,
                timings: StageTimings, on_step: StepCallback | None = None) -> tuple[torch.Tensor, str]:
        """(final latents [rows, C, f, h, w], cfg mode) from the request's seeded noise."""
        size = Size(request.width, request.height, request.frames)
        rows = request.batch
        generator = torch.Generator().manual_seed(int(request.seed))
        scheduler = make_scheduler(request.scheduler, self.scheduler_config, self.family.value)
        scheduler.set_timesteps(request.steps)
        # as WanPipeline does before its loop. WanImageToVideoPipeline does not: its first step looks its index up
        # from t, the same 0 unless the first timestep repeats, and then UniPC takes the second and overruns the
        # schedule on the last step (diffusers fails there: from 334 steps at flow_shift 3, `this_order > 0`)
        scheduler.set_begin_index(0)
        shape = (rows, self.channels, size.latent_frames(self.temporal_factor), *size.latent(self.vae_scale_factor))
        latents = torch.randn(shape, generator=generator, dtype=torch.float32)  # prepare_latents' one draw
        condition = None
        if self.image is not None:  # after the draw, as prepare_latents; neither encoder draws from the generator
            start = time.perf_counter()
            condition = self.image.condition(self.runners, request.init_image, size, rows)
            timings.image_encode_s = time.perf_counter() - start
        embeds = None if condition is None else condition.embeds
        cfg_mode = self._cfg_mode(size, rows) if negative is not None else "none"
        if cfg_mode == "batched":
            both = np.concatenate([negative, positive])
            embeds_both = None if embeds is None else np.concatenate([embeds, embeds])
        guidance_2 = request.guidance_scale if request.guidance_scale_2 is None else request.guidance_scale_2
        timesteps = scheduler.timesteps
        for index, t in enumerate(timesteps):
            start = time.perf_counter()
            if self.boundary_timestep is None or t >= self.boundary_timestep:
                expert, guidance = EXPERTS[0], request.guidance_scale
            else:
                expert, guidance = EXPERTS[1], guidance_2
            # img2vid: torch.cat([latents, condition], dim=1), as WanImageToVideoPipeline feeds every call
            sample = (latents if condition is None else torch.cat([latents, condition.channels], dim=1)).numpy()
            if cfg_mode == "batched":
                out = self._call(expert, size, np.concatenate([sample, sample]), t, both, embeds_both)
                uncond, cond = np.split(out, 2)
            elif cfg_mode == "parallel":  # split's two calls at once, each on its own instance: split's outputs
                cond, uncond = at_once(partial(self._call, expert, size, sample, t, positive, embeds),
                                       partial(self._call, expert, size, sample, t, negative, embeds, instance=1))
            else:  # WanPipeline's order: the conditional call, then the unconditional one
                cond = self._call(expert, size, sample, t, positive, embeds)
                uncond = self._call(expert, size, sample, t, negative, embeds) if cfg_mode == "split" else None
            noise_pred = torch.from_numpy(cond)
            if uncond is not None:
                noise_uncond = torch.from_numpy(uncond)
                noise_pred = noise_uncond + guidance * (noise_pred - noise_uncond)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            timings.step_s.append(time.perf_counter() - start)
            if on_step is not None:  # a preview, or a cancellation raised between steps
                on_step(index, len(timesteps), [latents])
        return latents, cfg_mode

    def _call(self, expert: str, size: Size, sample: np.ndarray, t, states: np.ndarray,
              image_embeds: np.ndarray | None = None, instance: int = 0) -> np.ndarray:
        runner = self.runners.find(expert, size=size, batch=sample.shape[0], instance=instance)
        # WanPipeline passes t.expand(rows): the integer UniPC timesteps are exact in float32
        feeds = {"hidden_states": sample, "timestep": np.full((sample.shape[0],), float(t), np.float32),
                 "encoder_hidden_states": states}
        if image_embeds is not None and "encoder_hidden_states_image" in runner.inputs:
            feeds["encoder_hidden_states_image"] = image_embeds
        return runner.run(feeds)["noise_pred"]

    def _cfg_mode(self, size: Size, rows: int) -> str:
        """`split` wherever a runner takes the request's rows (diffusers' two calls, bit for bit), `parallel` there
        when declared (the same calls at once); `batched` only where the engines are batch 2·rows alone: one call
        over both halves rounds differently (~1e-7), so that video is close to diffusers' but not equal."""
        for expert in self.experts:
            batches = self.runners.batches(expert, size)
            if None in batches or rows in batches:
                continue
            if 2 * rows in batches:
                return "batched"
            raise RuntimeInputError(f"no {expert} engine at {size} for batch {rows} with CFG (needs batch {rows} "
                                    f"or {2 * rows}); built: {sorted(b for b in batches if b)}")
        return "parallel" if self.parallel_cfg else "split"

    @property
    def experts(self) -> tuple[str, ...]:
        return EXPERTS if self.boundary_ratio is not None else EXPERTS[:1]

    # ---------------------------------------------------------------- VAE

    def decode(self, latents: torch.Tensor, size: Size, rows: int) -> np.ndarray:
        """Latents [rows, C, f, h, w] to the VAE's video [rows, 3, F, H, W] in [-1, 1]. The frame count follows
        from the latents (4f - 3), so a caller that knows only the image size routes to the right engine."""
        frames = self.temporal_factor * (latents.shape[2] - 1) + 1
        latents = latents / self.latents_std + self.latents_mean
        runner = self.runners.find("vae_decoder", size=Size(size.width, size.height, frames), batch=rows)
        return runner.run({"latent": latents.float().numpy()})["video"]
