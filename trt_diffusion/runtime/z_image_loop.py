"""The Z-Image text-to-image loop over runners (Z-Image and Z-Image-Turbo), step for step as diffusers'
`ZImagePipeline` runs it, so the torch reference runners reproduce its images bit for bit:

- prompt: a user turn under the tokenizer's chat template with the generation prompt and `enable_thinking=True`,
  padded and truncated to max_sequence_length (512); the encoder engine returns `hidden_states[-2]` and the host
  keeps the positions the mask keeps: one unpadded [L, D] per prompt (components/z_image.py). Repeated to the
  request's rows as the pipeline repeats its list.
- CFG: where `guidance_scale > 0` (Z-Image-Turbo's requests send 0: no CFG, one call over the rows). The negative
  prompt is the request's or "" (diffusers' default). One transformer call over the prompt's rows then the
  negative prompt's (`prompt_embeds + negative_prompt_embeds`), their states padded to the longer with a mask
  (`cfg: batched`, the pipeline's own call); where only engines at the request's rows exist, two calls (`split`).
  Combined per row `pos + s·(pos − neg)`. The request's cfg_truncation (CFG_TRUNCATION; default 1.0) sets the
  scale to 0 at the steps whose normalized time `(1000 - t) / 1000` is above it (and then one call, no CFG);
  its cfg_normalization (CFG_NORMALIZATION; default 0, diffusers' False: off) scales a row's guided prediction
  down to at most that many times the norm of its prompt's prediction. Both are the family's declared request
  inputs (families/z_image.py), at diffusers' defaults where the request leaves them out.
- noise: randn [rows, 16, h, w] (float32) from the request's generator; the transformer gets `(1000 - t) / 1000`
  and its output is negated before the scheduler's step.
- schedule: sigmas `linspace(1, 1/steps, steps)` (in float32, as the pipeline), `mu = calculate_shift` of the
  image's token count with the scheduler config's bounds, `set_begin_index(0)`.
- decode: `latents / scaling_factor + shift_factor`, the generic VAE decoder (the hub's `_decode_vae`).

Requests are not batched with each other (EnginePipeline.batch_key): a request's prompts set the call's text length.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ..components.z_image import padded_rows, prompt_embeds, prompt_tokens
from ..engines_file.engine_spec import Size
from ..errors import RuntimeInputError
from ..families import family_info
from ..families.z_image import Z_IMAGE_TEXT_LENGTH
from .engines import RunnerTable
from .family_loops import LoopAdapter, negative_embeds
from .requests import GenerationRequest, PromptEncoding, StageTimings, StepCallback, _Conditioning, input_value
from .schedulers import make_scheduler

PATCH = 2  # 2x2 latent pixels per transformer token


class ZImageLoop:
    """The Z-Image denoising loop of an EnginePipeline: what it reads of the model folder, and its runners."""

    def __init__(self, runners: RunnerTable, family: str, denoiser_config: dict, scheduler_config: dict, tokenizer,
                 *, vae_scale_factor: int, text_lengths: tuple[int, int, int]):
        self.runners, self.family, self.tokenizer = runners, family, tokenizer
        self.scheduler_config, self.vae_scale_factor = scheduler_config, vae_scale_factor
        self.channels = int(denoiser_config.get("in_channels", 16))
        self.text_lengths = text_lengths
        self.inputs = {d.argument: d for d in family_info(family).request_inputs}  # cfg_normalization, cfg_truncation

    # ---------------------------------------------------------------- text

    @staticmethod
    def runs_cfg(request: GenerationRequest) -> bool:
        """ZImagePipeline's do_classifier_free_guidance: any positive scale."""
        return request.guidance_scale > 0

    def encode(self, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray | None]:
        """(positive, negative) prompt states [L, D], each its own length; negative None without CFG."""
        positive = self._embeds(request.prompt)
        negative = self._embeds(request.negative_prompt or "") if self.runs_cfg(request) else None
        return positive, negative

    def _embeds(self, prompt: str) -> np.ndarray:
        ids, mask = prompt_tokens(self.tokenizer, prompt, Z_IMAGE_TEXT_LENGTH)
        runner = self.runners.find("text_encoder", size=None, batch=1)
        states = prompt_embeds(runner.run({"input_ids": ids, "attention_mask": mask})["prompt_embeds"], mask)
        low, high = self.text_lengths[0], self.text_lengths[2]
        if not low <= len(states) <= high:
            raise RuntimeInputError(
                f"the prompt is {len(states)} tokens after the chat template; the transformer engines take "
                f"{low} to {high} (engines.yaml's text_length: rebuild with a larger max, at most "
                f"{Z_IMAGE_TEXT_LENGTH}, ZImagePipeline's max_sequence_length)")
        return states

    # ---------------------------------------------------------------- the loop

    def latent_size(self, size: Size) -> tuple[int, int]:
        factor = self.vae_scale_factor * PATCH
        return PATCH * (size.height // factor), PATCH * (size.width // factor)

    def denoise(self, request: GenerationRequest, positive: np.ndarray, negative: np.ndarray | None,
                timings: StageTimings, on_step: StepCallback | None = None) -> tuple[torch.Tensor, str]:
        """(final latents [rows, 16, h, w], cfg mode) from the request's seeded noise."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

        size = Size(request.width, request.height)
        rows, steps = request.batch, request.steps
        h, w = self.latent_size(size)
        generator = torch.Generator().manual_seed(int(request.seed))
        latents = torch.randn((rows, self.channels, h, w), generator=generator, dtype=torch.float32)
        config = self.scheduler_config
        mu = calculate_shift((h // PATCH) * (w // PATCH), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        scheduler = make_scheduler(request.scheduler, config, self.family)
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), mu=mu)  # retrieve_timesteps' call
        scheduler.set_begin_index(0)
        timesteps = scheduler.timesteps
        cfg = negative is not None
        normalization = input_value(request, self.inputs["cfg_normalization"])
        truncation = input_value(request, self.inputs["cfg_truncation"])
        t_norms = ((1000 - timesteps.float()) / 1000).tolist() if cfg and truncation <= 1 else None
        cfg_mode = self._cfg_mode(size, rows) if cfg else "none"
        conditional = [positive] * rows
        for index, t in enumerate(timesteps):
            start = time.perf_counter()
            timestep = ((1000 - t.expand(rows)) / 1000).numpy()
            scale = request.guidance_scale
            if t_norms is not None and t_norms[index] > truncation:
                scale = 0.0
            sample = latents.numpy()
            if cfg and scale > 0:
                pos, neg = self._cfg_calls(cfg_mode, size, sample, timestep, conditional, [negative] * rows)
                noise_pred = torch.stack([_guided(p, n, scale, normalization) for p, n in zip(pos, neg)], dim=0)
            else:
                noise_pred = self._call(size, sample, timestep, conditional)
            latents = scheduler.step((-noise_pred).to(torch.float32), t, latents, return_dict=False)[0]
            timings.step_s.append(time.perf_counter() - start)
            if on_step is not None:  # a preview, or a cancellation raised between steps
                on_step(index, len(timesteps), [latents])
        return latents, cfg_mode

    def _cfg_calls(self, mode: str, size: Size, sample: np.ndarray, timestep: np.ndarray, positive: list,
                   negative: list) -> tuple[torch.Tensor, torch.Tensor]:
        if mode == "batched":  # the pipeline's call: latents.repeat(2), prompt list + negative list
            out = self._call(size, np.concatenate([sample, sample]), np.concatenate([timestep, timestep]),
                             positive + negative)
            return out[:len(positive)], out[len(positive):]
        return self._call(size, sample, timestep, positive), self._call(size, sample, timestep, negative)

    def _call(self, size: Size, sample: np.ndarray, timestep: np.ndarray, captions: list[np.ndarray]) -> torch.Tensor:
        embeds, mask = padded_rows(captions)
        runner = self.runners.find("transformer", size=size, batch=sample.shape[0])
        feeds = {"hidden_states": sample, "timestep": timestep.astype(np.float32, copy=False),
                 "encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}
        return torch.from_numpy(runner.run(feeds)["noise_pred"])

    def _cfg_mode(self, size: Size, rows: int) -> str:
        """`batched` (one call over twice the rows, as the pipeline) where such an engine exists, else `split`."""
        batches = self.runners.batches("transformer", size)
        if None in batches or 2 * rows in batches:
            return "batched"
        if rows in batches:
            return "split"
        raise RuntimeInputError(f"no transformer engine at {size} for batch {rows} with CFG (needs batch {2 * rows} "
                                f"or {rows}); built: {sorted(b for b in batches if b)}")


def _guided(pos: torch.Tensor, neg: torch.Tensor, scale: float, normalization: float) -> torch.Tensor:
    """One row's guided prediction, as ZImagePipeline writes it (in float32), its norm capped at `normalization`
    times the prompt's prediction's where `normalization` > 0."""
    pos, neg = pos.float(), neg.float()
    pred = pos + scale * (pos - neg)
    if normalization > 0.0:
        ori_pos_norm = torch.linalg.vector_norm(pos)
        new_pos_norm = torch.linalg.vector_norm(pred)
        max_new_norm = ori_pos_norm * float(normalization)
        if new_pos_norm > max_new_norm:
            pred = pred * (max_new_norm / new_pos_norm)
    return pred


class ZImageFamilyLoop(LoopAdapter):
    """The `FamilyLoop` (runtime/family_loops.py) of the z_image family: prompt states per prompt (each its own
    length), the loop above, and the hub's AutoencoderKL decode."""

    def __init__(self, hub):
        from ..families import family_info

        self.inner = ZImageLoop(
            hub.runners, hub.family.value, hub.denoiser_config, hub.scheduler_config, hub.tokenizers["tokenizer"],
            vae_scale_factor=hub.vae_scale_factor,
            text_lengths=tuple(hub.text_lengths or family_info(hub.family).text_lengths))
        self._decode_vae: Callable = hub._decode_vae

    def runs_cfg(self, request) -> bool:
        return self.inner.runs_cfg(request)

    def encode(self, request) -> PromptEncoding:
        positive, negative = self.inner.encode(request)
        return PromptEncoding(_Conditioning(positive), None if negative is None else _Conditioning(negative))

    def denoise(self, request, encoding, size, timings, on_step, threshold):
        return self.inner.denoise(request, encoding.positive.embeds, negative_embeds(encoding), timings, on_step)

    def decode(self, latents: torch.Tensor, size: Size, batch: int) -> np.ndarray:
        return self._decode_vae(latents, size, batch)
