"""Train a micro-model on the synthetic world (issue 43): `python scripts/train_micro.py --family sd15`.

Seeded and deterministic on one machine (fixed seeds, fixed thread count). Stages, each checkpointed in --work so
an interrupted run resumes at the stage it was in:

1. vae:  SD1.5's AutoencoderKL layout (small widths, one layer per block) on 32x32 crops of drawn scenes, L1 + MSE
         + a tiny KL, cosine-decayed rate.
2. unet: SD1.5's UNet layout (small widths) and a CLIP text encoder trained together (DDPM, epsilon, SD1.5's
         scaled_linear betas, 10 % empty captions for classifier-free guidance) on the frozen VAE's latents; the
         tokenizer is the project's character-level CLIP tokenizer, so the encoder learns the words.
   refine: the same, continued from the unet stage's weights with a lower rate (--refine-steps).
3. save: the pipeline as fp16 safetensors in --out (default trt_diffusion/data/micro/<family>/), with the
         script's version, seed, steps, time and the fp32 grid figures in trt_diffusion_micro.json.

`--family flux` trains the DiT micro-model in FLUX.1's layout instead (same stages, same checkpointing):

1. vae:  FLUX.1's VAE layout (16 latent channels, no quant convs), trained as sd15's; its shift and scale factors
         are measured on its latents afterwards.
2. dit:  FluxTransformer2DModel (double- then single-stream blocks) with a CLIP text encoder (pooled) and a T5
         encoder trained together: rectified flow as FLUX (x_t = (1 - t) x0 + t noise, target noise - x0,
         logit-normal t), latents shifted, scaled and packed 2x2 as FluxPipeline packs them, 10 % empty captions.
   refine: the same, continued at a lower rate; polish: continued again at a lower rate still (--polish-steps).
3. save: a FluxPipeline folder, evaluated with true CFG against the empty prompt (the transformer has no guidance
         embedding) and T5 at its tokenizer's length (32), the length it was trained at.

`--evaluate-only` samples the fixed grid (36 prompts x 4 seeds, Euler 20 steps, CFG 5) from --out and prints the
prompt-following figures.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trt_diffusion import synthetic_world as world  # noqa: E402
from trt_diffusion.micro_effects import control_scenes  # noqa: E402
from trt_diffusion.models import micro  # noqa: E402
from trt_diffusion.prompt_following import grid_figures  # noqa: E402

SCRIPT_VERSION = 3  # 2: a 32-wide VAE trained on L1 + MSE; 3: flux's polish phase
GRID_SEEDS = (0, 1, 2, 3)
GRID_STEPS = 20
GRID_CFG = 5.0
# steps per stage when not given: sd15's are the shipped model's; flux's fit ~55 minutes on 2 idle cores (a DiT step
# from the pool ~0.25 s, a VAE step ~0.21 s, the pool ~5 min)
DEFAULT_STEPS = {
    "sd15": {"vae_steps": 3000, "unet_steps": 3000, "refine_steps": 3000, "lora_steps": 1500, "controlnet_steps": 1500},
    "flux": {"vae_steps": 2000, "unet_steps": 3000, "refine_steps": 3000, "polish_steps": 4000, "lora_steps": 0,
             "controlnet_steps": 0},
}
FLUX_BATCH = 32
FLUX_POOL = 40_000  # scenes drawn and encoded once for the DiT phases (drawing + encoding was half a DiT step)
CROP = 32  # the VAE trains on crops of this size
LORA_FILE = "pytorch_lora_weights.safetensors"


def scenes(rng: np.random.Generator, count: int, style: str = "plain") -> tuple[torch.Tensor, list[str]]:
    """A batch of drawn scenes as [-1, 1] float images, and their captions."""
    drawn = [world.random_scene(rng, style=style) for _ in range(count)]
    return as_images(drawn), [scene.caption for scene in drawn]


def as_images(drawn: list[world.Scene]) -> torch.Tensor:
    images = np.stack([world.draw(scene) for scene in drawn]).astype(np.float32) / 127.5 - 1
    return torch.from_numpy(images).permute(0, 3, 1, 2)


def as_edge_maps(drawn: list[world.Scene]) -> torch.Tensor:
    """[0, 1] float control images, as diffusers' ControlNet pipelines feed them."""
    edges = np.stack([world.edge_map(scene) for scene in drawn]).astype(np.float32) / 255
    return torch.from_numpy(edges).permute(0, 3, 1, 2)


def cosine_rate(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 1e-2 * peak + 0.99 * peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def optimise(optimizer, loss: torch.Tensor, clip: list | None, label: str, step: int, steps: int,
             start: float) -> None:
    """One optimiser step on `loss` (gradients clipped to norm 1 over `clip`, when given), and a progress line every
    100 steps."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip, 1.0)
    optimizer.step()
    if step % 100 == 0 or step == steps - 1:
        print(f"{label} {step}/{steps} loss {loss.item():.4f}  {time.time() - start:.0f} s", flush=True)


def train_vae(work: Path, steps: int, seed: int, build=micro.sd15_vae):
    path = work / "vae"
    if (path / "config.json").is_file():
        return type(build()).from_pretrained(path)
    torch.manual_seed(seed)
    vae = build()
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    start = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_rate(step, steps, 1e-3)
        images, _ = scenes(rng, 16)
        # a 32x32 crop: the VAE is convolutional, and a quarter of the pixels is a quarter of the cost
        top, left = (int(v) for v in rng.integers(0, world.SIZE - CROP + 1, size=2) // 8 * 8)
        images = images[:, :, top:top + CROP, left:left + CROP]
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample()).sample
        # L1 beside MSE: MSE alone blurs a shape's corners, and the corners are what tell a square from a circle
        loss = (reconstruction - images).abs().mean() + torch.nn.functional.mse_loss(reconstruction, images) \
            + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            psnr = 10 * math.log10(4 / max(torch.nn.functional.mse_loss(reconstruction, images).item(), 1e-10))
            print(f"vae {step}/{steps} loss {loss.item():.5f} psnr {psnr:.1f} dB  {time.time() - start:.0f} s",
                  flush=True)
    vae.save_pretrained(path)
    return vae


def scaling_factor(vae, seed: int) -> float:
    with torch.no_grad():
        images, _ = scenes(np.random.default_rng(seed + 1), 256)
        return float(1.0 / vae.encode(images).latent_dist.sample().std())


def latent_shift_and_scale(vae, seed: int) -> tuple[float, float]:
    """FLUX's VAE config carries both: latents = (sample - shift_factor) * scaling_factor have mean 0, std 1."""
    with torch.no_grad():
        images, _ = scenes(np.random.default_rng(seed + 1), 256)
        latents = vae.encode(images).latent_dist.sample()
        return float(latents.mean()), float(1.0 / latents.std())


def flux_text(text_encoder, text_encoder_2, tokenizer, tokenizer_2, captions: list[str]):
    """(CLIP's pooled output, T5's states) as FluxPipeline.encode_prompt makes them, T5 padded to its tokenizer's
    length (what the project's runtime and the grid pass as max_sequence_length)."""
    ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    ids_2 = tokenizer_2(captions, padding="max_length", max_length=tokenizer_2.model_max_length, truncation=True,
                        return_tensors="pt").input_ids
    return text_encoder(ids).pooler_output, text_encoder_2(ids_2)[0]


def flux_loss(transformer, pooled: torch.Tensor, states: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """Rectified flow as FLUX trains: x_t = (1 - t) x0 + t noise, the transformer predicts noise - x0 (what
    FlowMatchEulerDiscreteScheduler steps along), t logit-normal. `latents` [B, 16, h, w], already shifted and
    scaled; packed 2x2 into tokens, with their position ids, by FluxPipeline's own helpers."""
    from diffusers import FluxPipeline

    batch, channels, height, width = latents.shape
    x0 = FluxPipeline._pack_latents(latents, batch, channels, height, width)
    noise = torch.randn_like(x0)
    t = torch.sigmoid(torch.randn(batch))
    noisy = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
    image_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, x0.device, x0.dtype)
    text_ids = torch.zeros(states.shape[1], 3)  # as encode_prompt's: every text token at position 0
    # the pipeline passes sigma (its timestep / 1000); the transformer scales it back by 1000 itself
    prediction = transformer(hidden_states=noisy, timestep=t, pooled_projections=pooled, encoder_hidden_states=states,
                             txt_ids=text_ids, img_ids=image_ids).sample
    return torch.nn.functional.mse_loss(prediction, noise - x0)


def encoded_pool(vae, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """`count` drawn scenes encoded once by the frozen VAE: (posterior means, posterior stds, captions). A DiT step
    draws its batch from them and samples the posterior, rather than drawing and encoding new scenes each step."""
    rng = np.random.default_rng(seed + 5)
    means, stds, captions = [], [], []
    with torch.no_grad():
        for first in range(0, count, 500):
            images, chunk = scenes(rng, min(500, count - first))
            posterior = vae.encode(images).latent_dist
            means.append(posterior.mean)
            stds.append(posterior.std)
            captions += chunk
    return torch.cat(means), torch.cat(stds), captions


DIT_PHASES = ("dit", "refine", "polish")  # in order: each continues from the one before


def train_dit(work: Path, vae, pool, steps: int, seed: int, *, phase: str = "dit", peak: float = 5e-4):
    """One phase of FLUX transformer + CLIP + T5 training, checkpointed in work/<phase> (as train_unet). `pool`:
    a function that returns encoded_pool's scenes (built only when a phase trains)."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    from trt_diffusion.models.tiny import _clip_tokenizer, _t5_tokenizer

    def load(folder: Path):
        return (FluxTransformer2DModel.from_pretrained(folder / "transformer"),
                CLIPTextModel.from_pretrained(folder / "text_encoder"),
                T5EncoderModel.from_pretrained(folder / "text_encoder_2"))

    path = work / phase
    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    if (path / "transformer" / "config.json").is_file():
        return (*load(path), tokenizer, tokenizer_2)
    torch.manual_seed(seed)
    order = DIT_PHASES.index(phase)
    start_from = DIT_PHASES[order - 1] if order else None
    if start_from is None:
        transformer, text_encoder, text_encoder_2 = \
            micro.flux_transformer(), micro.flux_text_encoder(), micro.flux_t5_encoder()
    else:
        transformer, text_encoder, text_encoder_2 = load(work / start_from)
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    means, stds, pool_captions = pool()
    rng = np.random.default_rng(seed + 2 + order)  # other draws for each continued phase
    parameters = [*transformer.parameters(), *text_encoder.parameters(), *text_encoder_2.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=peak, weight_decay=1e-2)
    vae.requires_grad_(False)
    start = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_rate(step, steps, peak)
        rows = rng.integers(0, len(pool_captions), FLUX_BATCH)
        captions = [pool_captions[i] if rng.random() >= 0.1 else "" for i in rows]  # unconditional rows: true CFG
        latents = (means[rows] + stds[rows] * torch.randn_like(means[rows]) - shift) * scale
        pooled, states = flux_text(text_encoder, text_encoder_2, tokenizer, tokenizer_2, captions)
        loss = flux_loss(transformer, pooled, states, latents)
        optimise(optimizer, loss, parameters, phase, step, steps, start)
    transformer.save_pretrained(path / "transformer")
    text_encoder.save_pretrained(path / "text_encoder")
    text_encoder_2.save_pretrained(path / "text_encoder_2")
    return transformer, text_encoder, text_encoder_2, tokenizer, tokenizer_2


def train_flux(work: Path, args):
    """The flux stages (vae, dit, refine): a FluxPipeline, fp32, in memory."""
    from diffusers import FluxPipeline

    vae = train_vae(work, args.vae_steps, args.seed, build=micro.flux_vae)
    shift, scale = latent_shift_and_scale(vae, args.seed)
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    pool = functools.cache(lambda: encoded_pool(vae, args.flux_pool, args.seed))
    parts = train_dit(work, vae, pool, args.unet_steps, args.seed)
    if args.refine_steps:
        parts = train_dit(work, vae, pool, args.refine_steps, args.seed, phase="refine", peak=2e-4)
    if args.refine_steps and args.polish_steps:  # the shapes' outlines sharpen slowly on 16 tokens
        parts = train_dit(work, vae, pool, args.polish_steps, args.seed, phase="polish", peak=1e-4)
    transformer, text_encoder, text_encoder_2, tokenizer, tokenizer_2 = parts
    return FluxPipeline(scheduler=micro.flux_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def train_unet(work: Path, vae, steps: int, seed: int, *, phase: str = "unet", start_from: str | None = None,
               peak: float = 5e-4):
    """One phase of UNet + text encoder training, checkpointed in work/<phase>: from scratch, or continued from
    an earlier phase's checkpoint (`start_from`) with a fresh cosine schedule peaking at `peak`."""
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    from trt_diffusion.models.tiny import _clip_tokenizer

    path = work / phase
    tokenizer = _clip_tokenizer()
    if (path / "unet" / "config.json").is_file():
        return (UNet2DConditionModel.from_pretrained(path / "unet"),
                CLIPTextModel.from_pretrained(path / "text_encoder"), tokenizer)
    torch.manual_seed(seed)
    if start_from is None:
        unet, text_encoder = micro.sd15_unet(), micro.sd15_text_encoder()
    else:
        unet = UNet2DConditionModel.from_pretrained(work / start_from / "unet")
        text_encoder = CLIPTextModel.from_pretrained(work / start_from / "text_encoder")
    noise_schedule = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                   num_train_timesteps=1000)
    factor = vae.config.scaling_factor
    rng = np.random.default_rng(seed + 2 + (start_from is not None))  # new scenes for a continued phase
    parameters = [*unet.parameters(), *text_encoder.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=peak, weight_decay=1e-2)
    vae.requires_grad_(False)
    start = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_rate(step, steps, peak)
        images, captions = scenes(rng, 32)
        captions = [c if rng.random() >= 0.1 else "" for c in captions]  # unconditional rows for CFG
        with torch.no_grad():
            latents = vae.encode(images).latent_dist.sample() * factor
        ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, 1000, (latents.shape[0],))
        noisy = noise_schedule.add_noise(latents, noise, timesteps)
        prediction = unet(noisy, timesteps, text_encoder(ids)[0]).sample
        loss = torch.nn.functional.mse_loss(prediction, noise)
        optimise(optimizer, loss, parameters, phase, step, steps, start)
    unet.save_pretrained(path / "unet")
    text_encoder.save_pretrained(path / "text_encoder")
    return unet, text_encoder, tokenizer


def _frozen_conditioning(text_encoder, tokenizer, vae, captions: list[str], images: torch.Tensor):
    with torch.no_grad():
        ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids
        return text_encoder(ids)[0], vae.encode(images).latent_dist.sample() * vae.config.scaling_factor


def _noised(latents: torch.Tensor):
    from diffusers import DDPMScheduler

    noise_schedule = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                   num_train_timesteps=1000)
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (latents.shape[0],))
    return noise_schedule.add_noise(latents, noise, timesteps), noise, timesteps


def train_lora(work: Path, vae, unet, text_encoder, tokenizer, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """A style LoRA: the outlined style, captioned with the plain words (no trigger word: loading it is the style).
    Rank 8 on the attention projections and the ResNet convolutions: an outline is a spatial change, more than
    attention alone moves. Returns the PEFT state dict in diffusers naming."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    from trt_diffusion.models.tiny import LORA_TARGETS

    path = work / "lora" / "pytorch_lora_weights.safetensors"
    if path.is_file():
        return load_file(path)
    torch.manual_seed(seed + 3)
    rng = np.random.default_rng(seed + 3)
    unet = copy.deepcopy(unet)  # PEFT's wrappers stay in a model after its adapter is deleted: train on a copy
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=[*LORA_TARGETS, "conv1", "conv2"]),
                     adapter_name="outlined")
    parameters = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.0)
    start = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_rate(step, steps, 1e-3)
        drawn = [world.random_scene(rng, style="outlined") for _ in range(32)]
        captions = [world.caption(d.shape, d.colour, d.background) if rng.random() >= 0.1 else "" for d in drawn]
        embeddings, latents = _frozen_conditioning(text_encoder, tokenizer, vae, captions, as_images(drawn))
        noisy, noise, timesteps = _noised(latents)
        loss = torch.nn.functional.mse_loss(unet(noisy, timesteps, embeddings).sample, noise)
        optimise(optimizer, loss, None, "lora", step, steps, start)
    state = {k: v.detach().clone().contiguous() for k, v in
             get_peft_model_state_dict(unet, adapter_name="outlined").items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, path)
    return state


def train_controlnet(work: Path, vae, unet, text_encoder, tokenizer, steps: int, seed: int):
    """A ControlNet on edge maps (what a Canny detector draws), from the trained UNet's encoder, the UNet frozen."""
    from diffusers import ControlNetModel

    path = work / "controlnet"
    if (path / "config.json").is_file():
        return ControlNetModel.from_pretrained(path)
    torch.manual_seed(seed + 4)
    rng = np.random.default_rng(seed + 4)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32, 64, 64))
    unet.requires_grad_(False)
    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=5e-4, weight_decay=1e-2)
    start = time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_rate(step, steps, 5e-4)
        drawn = [world.random_scene(rng) for _ in range(32)]
        captions = [d.caption if rng.random() >= 0.1 else "" for d in drawn]
        embeddings, latents = _frozen_conditioning(text_encoder, tokenizer, vae, captions, as_images(drawn))
        noisy, noise, timesteps = _noised(latents)
        down, mid = controlnet(noisy, timesteps, encoder_hidden_states=embeddings,
                               controlnet_cond=as_edge_maps(drawn), return_dict=False)
        prediction = unet(noisy, timesteps, embeddings, down_block_additional_residuals=down,
                          mid_block_additional_residual=mid).sample
        loss = torch.nn.functional.mse_loss(prediction, noise)
        optimise(optimizer, loss, list(controlnet.parameters()), "controlnet", step, steps, start)
    controlnet.save_pretrained(path)
    return controlnet


def grid_guidance(pipe) -> dict:
    """The guidance arguments of a grid call: CFG for SD; true CFG against the empty prompt for FLUX (no guidance
    embedding), with T5 at its tokenizer's length, the length it was trained at (FluxPipeline's default is 512)."""
    if hasattr(pipe, "transformer"):
        return {"true_cfg_scale": GRID_CFG, "negative_prompt": "",
                "max_sequence_length": pipe.tokenizer_2.model_max_length}
    return {"guidance_scale": GRID_CFG}


def sample_grid(pipe) -> tuple[list[np.ndarray], list[str]]:
    images, prompts = [], []
    for prompt in world.prompt_grid():  # a prompt's seeds in one call: each image's noise from its own seed
        generators = [torch.Generator().manual_seed(seed) for seed in GRID_SEEDS]
        out = pipe(prompt, num_inference_steps=GRID_STEPS, generator=generators, num_images_per_prompt=len(GRID_SEEDS),
                   height=world.SIZE, width=world.SIZE, output_type="np", **grid_guidance(pipe))
        images += [np.round(image * 255).astype(np.uint8) for image in out.images]
        prompts += [prompt] * len(GRID_SEEDS)
    return images, prompts


def load_pipeline(folder: Path):
    """The folder's own pipeline class (model_index.json's _class_name), fp32."""
    import diffusers

    name = json.loads((Path(folder) / "model_index.json").read_text())["_class_name"]
    extra = {"safety_checker": None, "requires_safety_checker": False} if name.startswith("StableDiffusion") else {}
    pipe = getattr(diffusers, name).from_pretrained(folder, torch_dtype=torch.float32, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def evaluate(folder: Path, picture: Path | None = None) -> dict[str, float]:
    pipe = load_pipeline(folder)
    images, prompts = sample_grid(pipe)
    if picture is not None:
        from PIL import Image

        rows = [np.concatenate(images[i:i + 12], axis=1) for i in range(0, len(images), 12)]
        Image.fromarray(np.concatenate(rows, axis=0)).save(picture)
    return grid_figures(images, prompts)


def evaluate_lora(folder: Path) -> dict[str, float]:
    """The share of the grid's images (one seed) drawn in the outlined style with the LoRA loaded at scale 1."""
    from diffusers import StableDiffusionPipeline

    from trt_diffusion.prompt_following import read_image

    pipe = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32, safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(folder / "lora", weight_name=LORA_FILE)
    outlined = 0
    for prompt in world.prompt_grid():
        out = pipe(prompt, num_inference_steps=GRID_STEPS, guidance_scale=GRID_CFG,
                   generator=torch.Generator().manual_seed(GRID_SEEDS[0]), height=world.SIZE, width=world.SIZE,
                   output_type="np")
        outlined += read_image(np.round(out.images[0] * 255).astype(np.uint8)).style == "outlined"
    return {"style_outlined_with_lora": 100.0 * outlined / len(world.prompt_grid())}


def evaluate_controlnet(folder: Path) -> dict[str, float]:
    """Mean overlap (IoU) of the drawn shape with the control scene's shape, and the share at or above 0.7."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline
    from PIL import Image

    from trt_diffusion.prompt_following import shape_overlap

    pipe = StableDiffusionControlNetPipeline.from_pretrained(
        folder, controlnet=ControlNetModel.from_pretrained(folder / "controlnet", torch_dtype=torch.float32),
        torch_dtype=torch.float32, safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    overlaps = []
    for scene in control_scenes(len(world.prompt_grid())):
        out = pipe(scene.caption, Image.fromarray(world.edge_map(scene)), num_inference_steps=GRID_STEPS,
                   guidance_scale=GRID_CFG, generator=torch.Generator().manual_seed(GRID_SEEDS[0]),
                   height=world.SIZE, width=world.SIZE, output_type="np")
        overlaps.append(shape_overlap(np.round(out.images[0] * 255).astype(np.uint8), world.shape_mask(scene)))
    return {"mean_overlap": float(np.mean(overlaps)), "share_at_least_0_7": 100.0 * float(np.mean(
        np.array(overlaps) >= 0.7))}


def weights_sha256(folder: Path) -> dict[str, str]:
    """relative name -> sha256 of every weight file: what a later check (tests/micro) holds the shipped files to."""
    import hashlib

    return {path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*.safetensors"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=micro.micro_families(), default="sd15")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-steps", type=int, default=None, help="default: sd15 3000, flux 2000")
    parser.add_argument("--unet-steps", type=int, default=None, help="the denoiser's (sd15: the UNet; flux: the "
                        "transformer) first phase, with its text encoders; default: 3000")
    parser.add_argument("--refine-steps", type=int, default=None, help="a second denoiser phase from the first's "
                        "weights, at a lower rate; default: 3000")
    parser.add_argument("--polish-steps", type=int, default=None, help="flux: a third denoiser phase from the "
                        "second's weights, at a lower rate still (default 4000; sd15: none)")
    parser.add_argument("--lora-steps", type=int, default=None, help="the outlined-style LoRA (0: none; sd15 only, "
                        "default 1500)")
    parser.add_argument("--controlnet-steps", type=int, default=None, help="the edge-map ControlNet (0: none; sd15 "
                        "only, default 1500)")
    parser.add_argument("--flux-pool", type=int, default=FLUX_POOL, help="flux: scenes encoded once for the DiT "
                        "phases to draw from (smaller only for smoke runs)")
    parser.add_argument("--threads", type=int, default=2, help="fixed for reproducible sums")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "micro-train")
    parser.add_argument("--out", type=Path, default=None, help="default trt_diffusion/data/micro/FAMILY")
    parser.add_argument("--evaluate-only", action="store_true")
    parser.add_argument("--picture", type=Path, default=None, help="also save the grid as a PNG here")
    args = parser.parse_args()
    for name, steps in DEFAULT_STEPS[args.family].items():
        if getattr(args, name) is None:
            setattr(args, name, steps)
    if args.family == "flux" and (args.lora_steps or args.controlnet_steps):
        parser.error("--lora-steps and --controlnet-steps: the flux micro-model has no LoRA or ControlNet stage; "
                     "give 0 or leave them out")
    if args.family == "sd15" and args.polish_steps:
        parser.error("--polish-steps: the sd15 micro-model has no polish phase (its UNet trains in two)")
    torch.set_num_threads(args.threads)
    out = args.out or micro.DATA / args.family
    if args.evaluate_only:
        print(json.dumps(evaluate(out, args.picture), indent=2))
        return
    from diffusers import StableDiffusionPipeline

    work = args.work / args.family
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if args.family == "flux":
        pipe, lora, controlnet = train_flux(work, args), None, None
        seconds = time.time() - start
    else:
        vae = train_vae(work, args.vae_steps, args.seed)
        vae.register_to_config(scaling_factor=scaling_factor(vae, args.seed))
        unet, text_encoder, tokenizer = train_unet(work, vae, args.unet_steps, args.seed)
        if args.refine_steps:  # the first phase's shapes follow the prompt's words only loosely (circle ~ square)
            unet, text_encoder, tokenizer = train_unet(work, vae, args.refine_steps, args.seed, phase="refine",
                                                       start_from="unet", peak=2e-4)
        lora = train_lora(work, vae, unet, text_encoder, tokenizer, args.lora_steps, args.seed) \
            if args.lora_steps else None
        controlnet = train_controlnet(work, vae, unet, text_encoder, tokenizer, args.controlnet_steps, args.seed) \
            if args.controlnet_steps else None
        seconds = time.time() - start
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                       scheduler=micro.sd15_scheduler(), safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    staging = out.with_name(f".{out.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    pipe.to(torch.float16).save_pretrained(staging, safe_serialization=True)
    if lora is not None:
        StableDiffusionPipeline.save_lora_weights(staging / "lora", unet_lora_layers={
            k: v.to(torch.float16) for k, v in lora.items()}, weight_name=LORA_FILE, safe_serialization=True)
    if controlnet is not None:
        controlnet.to(torch.float16).save_pretrained(staging / "controlnet", safe_serialization=True)
    figures = evaluate(staging, args.picture)  # fp16 weights upcast on load: the reference users get
    record = {"script_version": SCRIPT_VERSION, "family": args.family, "vocabulary": micro.VOCABULARY, "seed": args.seed,
              "vae_steps": args.vae_steps, "unet_steps": args.unet_steps, "refine_steps": args.refine_steps,
              **({"polish_steps": args.polish_steps} if args.family == "flux" else {}),
              "threads": args.threads,
              "train_seconds": round(seconds), "grid": {"prompts": len(world.prompt_grid()), "seeds": list(GRID_SEEDS),
                                                        "steps": GRID_STEPS, "cfg": GRID_CFG, "figures": figures}}
    if args.family == "flux":  # how the grid was guided: the transformer has no guidance embedding
        record["grid"].update(guidance="true_cfg_scale, negative_prompt ''",
                              max_sequence_length=pipe.tokenizer_2.model_max_length)
        record.update(batch=FLUX_BATCH, pool=args.flux_pool)
    if lora is not None:
        record["lora"] = {"steps": args.lora_steps, "style": "outlined", "figures": evaluate_lora(staging)}
    if controlnet is not None:
        record["controlnet"] = {"steps": args.controlnet_steps, "control": "edges",
                                "figures": evaluate_controlnet(staging)}
    record["weights_sha256"] = weights_sha256(staging)
    (staging / micro.TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
