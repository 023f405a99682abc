"""The FLUX.2 text-to-image loop over runners (dev and Klein), step for step as diffusers' `Flux2Pipeline` and
`Flux2KleinPipeline` run it, so the torch reference runners reproduce their images bit for bit:

- prompt: the chat template and the tokenizer on the host, padded and truncated to max_sequence_length (512):
  FLUX.2 dev as `_get_mistral_3_small_prompt_embeds` (system message + user turn, `apply_chat_template`), Klein as
  `_get_qwen3_prompt_embeds` (a user turn, generation prompt, `enable_thinking=False`). The encoder engine returns
  the stacked hidden states; repeated to the request's rows as `encode_prompt` repeats them.
- guidance: FLUX.2 dev embeds it (`guidance` = the scale, one call per step). Klein runs true CFG where the scale is
  above 1 and the checkpoint is not step-distilled (`is_distilled` in model_index.json): the prompt's call, then
  the negative prompt's (diffusers' "", or the request's NEGATIVE_PROMPT, which diffusers takes as
  `negative_prompt_embeds`), combined `neg + s·(cond − neg)`.
- noise: randn [rows, 128, h/2, w/2] (the 32 latent channels patchified 2×2) from the request's generator, packed
  to [rows, T, 128]; ids (0, row, col, 0) per token and (0, 0, 0, position) per text token.
- schedule: sigmas linspace(1, 1/steps, steps), `mu = compute_empirical_mu(T, steps)`, `set_begin_index(0)`; the
  transformer's timestep is `t / 1000` in float32.
- decode: the tokens scattered back to their grid [rows, 128, h/2, w/2]; the vae_decoder engine applies the VAE's
  batch-norm statistics and the unpatchify before decoding, as the pipelines do (components/flux2.py).

Requests are not batched with each other (EnginePipeline.batch_key): each runs over its own rows, as diffusers does.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..components.flux2 import image_ids, prompt_tokens, text_ids
from ..engines_file.engine_spec import Size
from ..families import CfgKind, Family, family_info
from .engines import split_cfg_mode
from .requests import GenerationRequest, StageTimings, StepCallback
from .schedulers import make_scheduler

PATCH = 2  # 2x2 latent pixels per token


class Flux2Loop:
    """The FLUX.2 (dev or Klein) denoising loop of an EnginePipeline: what it reads of the model folder, and its
    runners."""

    def __init__(self, runners, family: Family, index: dict, denoiser_config: dict, scheduler_config: dict,
                 tokenizer, *, vae_scale_factor: int):
        self.runners, self.family, self.tokenizer = runners, family, tokenizer
        self.scheduler_config, self.vae_scale_factor = scheduler_config, vae_scale_factor
        self.channels = int(denoiser_config["in_channels"])  # packed: 4 × the VAE's latent channels
        self.embedded_guidance = bool(denoiser_config.get("guidance_embeds", True))
        self.distilled = bool(index.get("is_distilled", False))

    # ---------------------------------------------------------------- text

    def true_cfg(self, request: GenerationRequest) -> bool:
        """Klein's do_classifier_free_guidance; FLUX.2 dev's guidance is embedded (never two calls)."""
        return (family_info(self.family).cfg_kind is CfgKind.true_cfg and request.guidance_scale > 1.0
                and not self.distilled)

    def encode(self, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray | None]:
        """(positive, negative) prompt embeddings [rows, 512, J]; negative None where true CFG does not run."""
        positive = self._embeds(request.prompt, request.batch)
        negative = self._embeds(request.negative_prompt or "", request.batch) if self.true_cfg(request) else None
        return positive, negative

    def _embeds(self, prompt: str, rows: int) -> np.ndarray:
        ids, mask = prompt_tokens(self.family, self.tokenizer, prompt)
        runner = self.runners.find("text_encoder", size=None, batch=1)
        embeds = runner.run({"input_ids": ids, "attention_mask": mask})["prompt_embeds"]
        return np.repeat(embeds, rows, axis=0)  # encode_prompt's repeat(1, n, 1).view(n, L, J)

    # ---------------------------------------------------------------- the loop

    def latent_size(self, size: Size) -> tuple[int, int]:
        """The VAE's latent height and width (even: 2x2 patches)."""
        factor = self.vae_scale_factor * PATCH
        return PATCH * (size.height // factor), PATCH * (size.width // factor)

    def denoise(self, request: GenerationRequest, positive: np.ndarray, negative: np.ndarray | None,
                timings: StageTimings, on_step: StepCallback | None = None) -> tuple[torch.Tensor, str]:
        """(final packed latents [rows, T, 128], cfg mode) from the request's seeded noise."""
        from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline, compute_empirical_mu

        size = Size(request.width, request.height)
        rows, steps = request.batch, request.steps
        h, w = self.latent_size(size)
        generator = torch.Generator().manual_seed(int(request.seed))
        noise = torch.randn((rows, self.channels, h // PATCH, w // PATCH), generator=generator, dtype=torch.float32)
        latents = Flux2Pipeline._pack_latents(noise)
        img_ids, txt_ids = image_ids(h, w), text_ids(positive.shape[1])
        scheduler = make_scheduler(request.scheduler, self.scheduler_config, self.family.value)
        mu = compute_empirical_mu(latents.shape[1], steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):  # retrieve_timesteps without sigmas
            scheduler.set_timesteps(steps, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        scheduler.set_begin_index(0)
        cfg_mode = "none" if negative is None else self._cfg_mode(size, rows)
        guidance = np.full((rows,), request.guidance_scale, dtype=np.float32) if self.embedded_guidance else None
        timesteps = scheduler.timesteps
        for index, t in enumerate(timesteps):
            start = time.perf_counter()
            timestep = (t.expand(rows).to(latents.dtype) / 1000).numpy()  # as diffusers divides, in float32
            sample = latents.numpy()
            noise_pred = self._call(size, sample, timestep, guidance, positive, img_ids, txt_ids)
            if negative is not None:
                neg_noise_pred = self._call(size, sample, timestep, guidance, negative, img_ids, txt_ids)
                noise_pred = neg_noise_pred + request.guidance_scale * (noise_pred - neg_noise_pred)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            timings.step_s.append(time.perf_counter() - start)
            if on_step is not None:  # a preview, or a cancellation raised between steps
                on_step(index, len(timesteps), [latents])
        return latents, cfg_mode

    def _call(self, size: Size, sample: np.ndarray, timestep: np.ndarray, guidance: np.ndarray | None,
              embeds: np.ndarray, img_ids: np.ndarray, txt_ids: np.ndarray) -> torch.Tensor:
        runner = self.runners.find("transformer", size=size, batch=sample.shape[0])
        feeds = {"hidden_states": sample, "timestep": timestep, "encoder_hidden_states": embeds,
                 "img_ids": img_ids, "txt_ids": txt_ids}
        if guidance is not None:
            feeds["guidance"] = guidance
        return torch.from_numpy(runner.run(feeds)["noise_pred"])

    def _cfg_mode(self, size: Size, rows: int) -> str:
        """`split`, Flux2KleinPipeline's two calls over the request's rows: the only mode run (engines at twice the
        rows alone are refused, not guessed at)."""
        return split_cfg_mode(self.runners, size, rows, "FLUX.2 Klein", "the prompt and the negative prompt")

    # ---------------------------------------------------------------- VAE

    def decode(self, latents: torch.Tensor, size: Size, rows: int) -> np.ndarray:
        """Packed latents to the VAE's images [rows, 3, H, W] in [-1, 1]: the tokens scattered back to their grid
        [rows, 128, h/2, w/2]; the engine denormalizes and unpatchifies (components/flux2.py)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

        h, w = self.latent_size(size)
        grid = torch.from_numpy(image_ids(h, w))[None].expand(rows, -1, -1)
        latents = Flux2Pipeline._unpack_latents_with_ids(latents, grid)
        runner = self.runners.find("vae_decoder", size=size, batch=rows)
        return runner.run({"latent": latents.float().numpy()})["images"]
