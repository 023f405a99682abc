"""The Qwen-Image text-to-image loop over runners, step for step as diffusers' `QwenImagePipeline` runs it, so the
torch reference runners reproduce its images bit for bit:

- prompt: `prompt_template_encode.format(prompt)`, tokenized as `_get_qwen_prompt_embeds` does (one prompt: no
  padding, `max_length` 1024 + 34, truncated), cut to the encoder engine's 34 + text max where longer (the encoder is
  causal: the states kept do not depend on the ids cut), run; then `components.qwen_image.prompt_embeds` (the
  template's 34 positions dropped, cut to max_sequence_length), repeated to the request's rows as `encode_prompt`
  repeats them. One encoder call for the prompt, one for the negative prompt, each with its own length.
- true CFG: only with `guidance_scale` (= diffusers' `true_cfg_scale`) > 1 *and* a negative prompt (`""` counts;
  None does not), as `do_true_cfg`. Per step the conditional call, then the negative one (each its own text length
  and mask: `split`), combined `neg + s·(cond − neg)` and rescaled to the conditional prediction's norm over the 64
  packed channels, in torch as diffusers writes it.
- noise: randn [rows, 1, 16, h, w] from the request's generator (its only draw), packed 2×2; the transformer sees
  the packed tokens viewed as [rows, h/2, w/2, 64] (the same memory) and answers in that view.
- schedule: sigmas linspace(1, 1/steps, steps), `mu` from the image's token count (`calculate_shift` with the
  scheduler config's bounds), `set_begin_index(0)`; the transformer's timestep is `t / 1000` in float32.
- decode: unpacked [rows, 16, 1, h, w], `latents / (1 / latents_std) + latents_mean`, the vae_decoder runner on the
  frame (its graph adds the frame axis back), then the image families' uint8 conversion (pipeline.py).

img2img and inpaint, as `QwenImageImg2ImgPipeline` / `QwenImageInpaintPipeline`:

| workflow | generator draws | what the transformer sees |
|---|---|---|
| img2img | init latent, noise | the init image's normalized latent noised to the first kept sigma |
| inpaint | init latent, noise (then a masked latent, never used) | as img2img; the known region blended back after each step on packed latents |

The init latent is `mean + std * randn` of the vae_encoder runner's outputs, normalized per channel
`(latent - latents_mean) * (1 / latents_std)`; strength trims the schedule's head by the float product (SD3's and
FLUX's `get_timesteps`), and the shift `mu` is the txt2img one. The inpaint pipeline encodes the init image at every
strength, 1 included (there the first sigma is 1: the start is the noise itself), and encodes the masked image last,
for nothing: a plain transformer, so that draw is left out. Its mask is the request's, nearest-resized to the
latent grid and repeated over the 16 channels before packing.

The mask: diffusers passes `None` for an all-ones prompt mask, the engines always take the mask (all ones there).
The transformer's attention gives the same bits either way on the reference (tests/runtime/test_qwen_image_reference.py).

edit, as `QwenImageEditPipeline` (components/qwen_image_edit.py says where each part runs):

- the reference image is resized (Lanczos) to about 1024² at its own aspect; the processor cuts it into patches, the
  image_encoder runner embeds them, and each prompt (the edit template, `<|image_pad|>` repeated once per embedding)
  runs through the text_encoder runner with those embeddings and its 3D position ids; the first 64 positions are
  dropped. Prompt and negative prompt share the one image embedding (diffusers computes it twice, the same values).
- the vae_encoder runner's latent mean of the resized image (no draw), `(mean - latents_mean) / latents_std` (a
  division here, where img2img multiplies by the inverse), packed, repeated to the rows; beside the noise tokens in
  every transformer call, whose answer is the noise tokens'. The schedule is txt2img's, the noise the only draw.

Requests are not batched with each other (EnginePipeline.batch_key): diffusers runs the transformer over one
request's rows with that prompt's text length; another request's prompt has its own length (padding it would be
another computation), and linear layers round differently over more rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..components.qwen_image import prompt_embeds, prompt_tokens
from ..components.qwen_image_edit import IMAGE_BLOCK, IMAGE_PAD, edit_prompt_embeds, rope_positions
from ..engines_file.engine_spec import Size
from ..errors import RuntimeInputError
from ..families import (
    QWEN_EDIT_TEMPLATE,
    QWEN_EDIT_TEMPLATE_TOKENS,
    QWEN_MAX_TEXT_LENGTH,
    QWEN_TEXT_LENGTH,
    Family,
    family_info,
)
from ..models.edit_reference import condition_size
from ..workflows import Workflow
from . import conditioning
from .engines import split_cfg_mode
from .requests import GenerationRequest, StageTimings, StepCallback
from .schedulers import make_scheduler

PATCH = 2  # 2x2 latent pixels per token

@dataclass
class QwenText:
    """One prompt's states as encode_prompt returns them, repeated to the request's rows: [rows, S, D] and [rows, S]."""

    embeds: np.ndarray
    mask: np.ndarray


def qwen_problems(request: GenerationRequest, loop: QwenImageLoop | None) -> list[str]:
    """What is wrong with a request's Qwen-Image fields (MAX_SEQUENCE_LENGTH, the workflow) for this pipeline."""
    length = request.max_sequence_length
    if loop is None:
        return [] if length is None else [
            "MAX_SEQUENCE_LENGTH is the qwen_image family's (its prompts keep a variable number of tokens); this "
            "family's prompts are padded to its text encoders' length"]
    problems = []
    if length is not None and loop.edit is not None:
        return ["MAX_SEQUENCE_LENGTH is not an edit's: QwenImageEditPipeline keeps the whole prompt (up to the "
                "engines' text_length max)"]
    if length is not None:
        low, high = loop.text_lengths[0], loop.text_lengths[2]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            problems.append(f"MAX_SEQUENCE_LENGTH must be a whole number, got {length!r}")
        elif not low <= length <= high:
            why = (f"the engines' text_length max is {high}: rebuild with a larger text_length in engines.yaml "
                   f"(at most {QWEN_MAX_TEXT_LENGTH}, diffusers' limit)" if length > high
                   else f"the engines take at least {low} text tokens")
            problems.append(f"MAX_SEQUENCE_LENGTH must be between {low} and {high}, got {length} ({why})")
    return problems


@dataclass
class EditParts:
    """What an edit checkpoint adds to the loop: its processor's image half, the encoder's placeholder id and the
    vision tower's merge size."""

    image_processor: object
    image_token_id: int
    merge_size: int

    @classmethod
    def load(cls, model_dir) -> EditParts:
        import json
        from pathlib import Path

        from ..models.edit_reference import image_processor

        config = json.loads((Path(model_dir) / "text_encoder" / "config.json").read_text())
        return cls(image_processor(model_dir), int(config["image_token_id"]),
                   int(config["vision_config"]["spatial_merge_size"]))


def qwen_edit_image_problems(image: np.ndarray, request: GenerationRequest) -> list[str]:
    """An edit's reference image may have any size (the pipeline resizes it to about 1024² at its aspect), but its
    resized size must be the request's size's: the engines of a bucket are built for that one reference grid."""
    if image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
        return [f"INIT_IMAGE is {list(image.shape)}, expected [height, width, 3]"]
    height, width = image.shape[:2]
    resized, wanted = condition_size(width, height), condition_size(request.width, request.height)
    if resized == wanted:
        return []
    return [f"INIT_IMAGE is {width}x{height}: Qwen-Image-Edit resizes it to {resized[0]}x{resized[1]}, but a "
            f"{request.width}x{request.height} request's reference is resized to {wanted[0]}x{wanted[1]} (its "
            f"aspect): send the reference image at the request's aspect, or ask for a size of the image's"]


class QwenLatentEncoder(conditioning.LatentEncoder):
    """The vae_encoder runner with Qwen-Image's latent normalization: per channel, `(latent - latents_mean) *
    (1 / latents_std)` as `_encode_vae_image` writes it (`inverse_std` is that 1 / latents_std)."""

    def __init__(self, runner, family: Family, latents_mean: torch.Tensor, inverse_std: torch.Tensor):
        super().__init__(runner, family, scaling_factor=1.0, shift_factor=0.0)
        self.latents_mean, self.inverse_std = latents_mean, inverse_std

    def _scaled(self, sample: torch.Tensor) -> torch.Tensor:
        return (sample - self.latents_mean) * self.inverse_std


class QwenImageLoop:
    """The Qwen-Image denoising loop of an EnginePipeline: what it reads of the model folder, and its runners.

    `text_lengths`: the engines' (min, opt, max) prompt tokens (engines.yaml's `text_length`); None: the family's
    (2, 128, 512). A prompt longer than the max is truncated there, as diffusers truncates at max_sequence_length."""

    def __init__(self, runners, denoiser_config: dict, scheduler_config: dict, vae_config: dict, tokenizer, *,
                 vae_scale_factor: int, text_lengths: tuple[int, int, int] | None = None, edit: EditParts | None = None,
                 family: Family | str):
        self.runners, self.tokenizer, self.edit, self.family = runners, tokenizer, edit, Family(family)
        self.scheduler_config = scheduler_config
        self.vae_scale_factor = vae_scale_factor
        self.text_lengths = tuple(text_lengths or family_info(self.family).text_lengths)
        self.channels = int(denoiser_config["in_channels"]) // (PATCH * PATCH)  # num_channels_latents
        z_dim = int(vae_config["z_dim"])
        # as QwenImagePipeline builds them: float32 tensors, the std inverted once and divided by at decode
        self.latents_mean = torch.tensor(vae_config["latents_mean"]).view(1, z_dim, 1, 1, 1)
        self.latents_std = 1.0 / torch.tensor(vae_config["latents_std"]).view(1, z_dim, 1, 1, 1)
        self.edit_std = torch.tensor(vae_config["latents_std"]).view(1, z_dim, 1, 1)  # the edit pipeline divides

    def max_sequence_length(self, request: GenerationRequest) -> int:
        """The request's, else diffusers' default 512 where the engines take it (their max otherwise)."""
        if request.max_sequence_length is not None:
            return int(request.max_sequence_length)
        return min(QWEN_TEXT_LENGTH, self.text_lengths[2])

    # ---------------------------------------------------------------- text

    def encode(self, request: GenerationRequest) -> tuple[QwenText, QwenText | None]:
        """(positive, negative); negative None where true CFG does not run (diffusers' do_true_cfg)."""
        if request.resolved_workflow is Workflow.edit:
            return self._edit_texts(request)
        length = self.max_sequence_length(request)
        positive = self._text(request.prompt, length, request.batch)
        negative = None
        if self.true_cfg(request):
            negative = self._text(request.negative_prompt, length, request.batch)
        return positive, negative

    @staticmethod
    def true_cfg(request: GenerationRequest) -> bool:
        return request.guidance_scale > 1.0 and request.negative_prompt is not None

    def _text(self, prompt: str, max_sequence_length: int, rows: int) -> QwenText:
        ids, mask = prompt_tokens(self.tokenizer, prompt, self.text_lengths[2])
        runner = self.runners.find("text_encoder", size=None, batch=1)
        states = runner.run({"input_ids": ids, "attention_mask": mask})["hidden_states"]
        embeds, embeds_mask = prompt_embeds(states, mask, max_sequence_length)
        # encode_prompt's repeat(1, n, 1).view(n, S, D): the prompt's row n times
        return QwenText(np.repeat(embeds, rows, axis=0), np.repeat(embeds_mask, rows, axis=0))

    def _edit_texts(self, request: GenerationRequest) -> tuple[QwenText, QwenText | None]:
        """The edit prompts' states, each holding the reference image's embeddings (computed once)."""
        image = self._reference(request)
        pixels = self.edit.image_processor(images=image, return_tensors="np")
        _, grid_h, grid_w = (int(v) for v in pixels["image_grid_thw"][0])
        size = Size(request.width, request.height)  # the engines of the request's bucket know its reference grid
        runner = self.runners.find("image_encoder", size=size, batch=1)
        patches = pixels["pixel_values"].astype(np.float32).reshape(grid_h, grid_w, -1)
        embeds = runner.run({"patches": patches})["image_embeds"]

        def text(prompt: str, which: str) -> QwenText:
            prompt_text = QWEN_EDIT_TEMPLATE.format(prompt).replace(IMAGE_PAD, IMAGE_PAD * len(embeds))
            tokens = self.tokenizer([prompt_text], padding=True, return_tensors="np")
            ids = tokens.input_ids.astype(np.int64)
            # the text axis: what follows the image block (the prompt and the template's tail), not cut by diffusers
            text = ids.shape[1] - QWEN_EDIT_TEMPLATE_TOKENS - IMAGE_BLOCK - len(embeds)
            if text > self.text_lengths[2]:
                raise RuntimeInputError(
                    f"{which} has {text} tokens with the edit template's tail; the engines take at most "
                    f"{self.text_lengths[2]} (engines.yaml's text_length max): QwenImageEditPipeline does not cut "
                    f"an edit's prompt, so neither does this pipeline")
            positions = rope_positions(ids, self.edit.image_token_id, (grid_h, grid_w), self.edit.merge_size)
            states = self.runners.find("text_encoder", size=size, batch=1).run(
                {"input_ids": ids, "attention_mask": tokens.attention_mask.astype(np.int64),
                 "position_ids": positions, "image_embeds": embeds})["hidden_states"]
            states, mask = edit_prompt_embeds(states)
            return QwenText(np.repeat(states, request.batch, axis=0), np.repeat(mask, request.batch, axis=0))

        negative = text(request.negative_prompt, "NEGATIVE_PROMPT") if self.true_cfg(request) else None
        return text(request.prompt, "PROMPT"), negative

    def _reference(self, request: GenerationRequest):
        """The request's image as QwenImageEditPipeline resizes it: Lanczos, to about 1024² at its aspect."""
        from PIL import Image

        height, width = request.init_image.shape[:2]
        return Image.fromarray(request.init_image).resize(condition_size(width, height), resample=Image.LANCZOS)

    def _edit_latents(self, request: GenerationRequest) -> torch.Tensor:
        """The resized reference image's normalized latent mean [rows, 16, h', w'] (`sample_mode="argmax"`)."""
        image = self._reference(request)
        runner = self.runners.find("vae_encoder", size=Size(request.width, request.height), batch=1)
        mean = runner.run({"images": conditioning.image_tensor(np.asarray(image)).numpy()})["latent"]
        latents = (torch.from_numpy(mean) - self.latents_mean[:, :, 0]) / self.edit_std
        return torch.cat([latents] * request.batch, dim=0)

    # ---------------------------------------------------------------- the loop

    def latent_size(self, size: Size) -> tuple[int, int]:
        factor = self.vae_scale_factor * PATCH
        return PATCH * (size.height // factor), PATCH * (size.width // factor)

    def denoise(self, request: GenerationRequest, positive: QwenText, negative: QwenText | None,
                timings: StageTimings, on_step: StepCallback | None = None) -> tuple[torch.Tensor, str]:
        """(final packed latents [rows, tokens, 64], cfg mode) from the request's seeded noise."""
        from diffusers import QwenImagePipeline
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        size = Size(request.width, request.height)
        rows, steps = request.batch, request.steps
        generator = torch.Generator().manual_seed(int(request.seed))
        h, w = self.latent_size(size)
        scheduler = make_scheduler(request.scheduler, self.scheduler_config, self.family.value)
        config = scheduler.config
        mu = calculate_shift((h // PATCH) * (w // PATCH), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        scheduler.set_begin_index(0)
        timesteps, blend, context = scheduler.timesteps, None, None
        if request.resolved_workflow is Workflow.edit:
            reference = self._edit_latents(request)  # no draw: the noise below is the generator's first
            _, _, ref_h, ref_w = reference.shape
            context = QwenImagePipeline._pack_latents(reference, rows, self.channels, ref_h, ref_w).view(
                rows, ref_h // PATCH, ref_w // PATCH, -1).numpy()
        if request.resolved_workflow in (Workflow.txt2img, Workflow.edit):
            noise = torch.randn((rows, 1, self.channels, h, w), generator=generator, dtype=torch.float32)
            latents = QwenImagePipeline._pack_latents(noise, rows, self.channels, h, w)
        else:
            latents, timesteps, blend = self._image_start(request, size, scheduler, generator)
        cfg_mode = self._cfg_mode(size, rows) if negative is not None else "none"
        scale = request.guidance_scale
        for index, t in enumerate(timesteps):
            start = time.perf_counter()
            timestep = (t.expand(rows).to(latents.dtype) / 1000).numpy()  # as diffusers divides, in float32
            sample = latents.view(rows, h // PATCH, w // PATCH, -1).numpy()
            noise_pred = self._call(size, sample, timestep, positive, latents.shape, context)
            if negative is not None:
                neg_noise_pred = self._call(size, sample, timestep, negative, latents.shape, context)
                comb_pred = neg_noise_pred + scale * (noise_pred - neg_noise_pred)
                cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
                noise_pred = comb_pred * (cond_norm / noise_norm)
            latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            if blend is not None:
                latents = conditioning.blend_known_region(blend, scheduler, self.family, latents, index)
            timings.step_s.append(time.perf_counter() - start)
            if on_step is not None:  # a preview, or a cancellation raised between steps
                on_step(index, len(timesteps), [latents])
        return latents, cfg_mode

    def _image_start(self, request: GenerationRequest, size: Size, scheduler, generator: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor, conditioning.ImageStart | None]:
        """(packed start latents, the trimmed schedule, the inpaint blend's state or None) for img2img / inpaint,
        drawing from `generator` in the pipelines' order: the init image's latent sample, then the noise."""
        from diffusers import QwenImagePipeline

        rows = request.batch
        h, w = self.latent_size(size)
        timesteps = conditioning.trim_timesteps(scheduler, request.steps, request.resolved_strength,
                                                self.family)
        encoder = QwenLatentEncoder(self.runners.find("vae_encoder", size=size, batch=1), self.family,
                                    self.latents_mean[:, :, 0], self.latents_std[:, :, 0])
        # the noise drawn [rows, C, h, w]: the numbers prepare_latents draws as [rows, 1, C, h, w]
        image_latents, noise, latents = conditioning.noised_image(
            encoder, conditioning.image_tensor(request.init_image), generator, scheduler, timesteps, rows)

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            return QwenImagePipeline._pack_latents(tensor, rows, self.channels, h, w)

        if request.resolved_workflow is Workflow.img2img:
            return pack(latents), timesteps, None
        blend = conditioning.packed_blend(timesteps, image_latents, noise, conditioning.mask_tensor(request.mask), pack)
        return pack(latents), timesteps, blend

    def _call(self, size: Size, sample: np.ndarray, timestep: np.ndarray, text: QwenText, shape,
              context: np.ndarray | None = None) -> torch.Tensor:
        runner = self.runners.find("transformer", size=size, batch=sample.shape[0])
        feeds = {"hidden_states": sample, "timestep": timestep, "encoder_hidden_states": text.embeds,
                 "encoder_hidden_states_mask": text.mask}
        if context is not None:
            feeds["image_latents"] = context  # edit: the reference image's tokens, after the noise's in the graph
        out = runner.run(feeds)["noise_pred"]
        return torch.from_numpy(out).reshape(shape)  # the packed [rows, tokens, 64] view again

    def _cfg_mode(self, size: Size, rows: int) -> str:
        """`split` (diffusers' two calls, each over the request's rows with its own text length): the only mode
        that is diffusers' computation, so the only one run; `cfg: batched` engines alone are refused."""
        return split_cfg_mode(self.runners, size, rows, "Qwen-Image",
                              "the prompt and the negative prompt, each with its own text length,")

    # ---------------------------------------------------------------- VAE

    def decode(self, latents: torch.Tensor, size: Size, rows: int) -> np.ndarray:
        """Packed latents to the VAE's images [rows, 3, H, W] in [-1, 1]."""
        from diffusers import QwenImagePipeline

        latents = QwenImagePipeline._unpack_latents(latents, size.height, size.width, self.vae_scale_factor)
        latents = latents / self.latents_std + self.latents_mean
        runner = self.runners.find("vae_decoder", size=size, batch=rows)
        return runner.run({"latent": latents[:, :, 0].numpy()})["images"]
