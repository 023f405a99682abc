"""Trained micro-models (issue 43): real block layouts with small widths, trained here on the synthetic world
(synthetic_world.py) by scripts/train_micro.py, shipped as fp16 safetensors in trt_diffusion/data/micro/<family>/
and written out, upcast to fp32 (the reference), as a normal diffusers folder by `models micro`.

The architectures live here so that the training script and the tests build the same modules: SD1.5's UNet keeps
its four levels, two layers per block and cross-attention on the three upper levels (DeepCache's figures depend
on that layout); only the widths shrink. FLUX.1's transformer keeps its double-stream blocks followed by
single-stream blocks (first-block caching reads the first double block's residual), its 2x2 packing of a 16-channel
latent (patch_size 1, 64 input channels) and its two text encoders (CLIP's pooled output, T5's states).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import ConfigError
from ..families import FAMILIES
from ..workspace.files import staged_folder

DATA = Path(__file__).resolve().parent.parent / "data" / "micro"
TRAINING_RECORD = "trt_diffusion_micro.json"  # the script's version, seed and figures, beside the weights
TEXT_HIDDEN = 64
LORA_FILE = "lora/pytorch_lora_weights.safetensors"  # the outlined-style LoRA, beside the pipeline's folders
VOCABULARY = "synthetic-world/1"  # what a folder's training record declares when it draws the synthetic world


def micro_families() -> tuple[str, ...]:
    """The families a micro-model ships for (their declarations' `micro_model`)."""
    return tuple(family.value for family, info in FAMILIES.items() if info.micro_model)


def draws_synthetic_world(model_dir: str | os.PathLike) -> bool:
    """Whether the model folder declares the synthetic world's vocabulary (its prompts then have a reading:
    prompt_following.py). A user's checkpoint has no record: False."""
    record = Path(model_dir) / TRAINING_RECORD
    try:
        return json.loads(record.read_text()).get("vocabulary") == VOCABULARY
    except (OSError, ValueError, AttributeError):
        return False


def sd15_text_encoder():
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(
        bos_token_id=512, eos_token_id=513, pad_token_id=513, hidden_size=TEXT_HIDDEN, intermediate_size=128,
        layer_norm_eps=1e-5, num_attention_heads=4, num_hidden_layers=3, vocab_size=1000, hidden_act="gelu",
        max_position_embeddings=77))


def sd15_vae():
    from diffusers import AutoencoderKL

    # four blocks (SD's 8x spatial factor), one layer each: its full-resolution convolutions are most of a training
    # step's cost. 32 channels at full resolution, not 16: a 16-wide VAE rounds circles into squares (its decoded
    # scenes read as the drawn shape 72 % of the time, against 94 % for this one), a ceiling no UNet gets past
    return AutoencoderKL(block_out_channels=[32, 64, 64, 64], in_channels=3, out_channels=3,
                         down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                         latent_channels=4, norm_num_groups=8, layers_per_block=1, sample_size=64)


def sd15_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64, 64, 64), layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_HIDDEN, attention_head_dim=8, norm_num_groups=16)


def sd15_scheduler():
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")


FLUX_LATENT_CHANNELS = 16  # FLUX.1's VAE; packed 2x2 into 64 transformer input channels


def flux_text_encoder():
    """FluxPipeline's CLIPTextModel: only its pooled output (the EOS token's state) is read."""
    return sd15_text_encoder()


def flux_t5_encoder():
    """FluxPipeline's T5EncoderModel: its states are the transformer's text tokens (vocabulary: the project's tiny
    T5 tokenizer's 124 pieces)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(d_model=TEXT_HIDDEN, d_ff=128, d_kv=16, num_heads=4, num_layers=2, vocab_size=128,
                      relative_attention_num_buckets=16, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False)
    config._attn_implementation = "eager"  # the dynamo exporter cannot trace T5's sdpa path (models/tiny.py)
    return T5EncoderModel(config)


def flux_vae():
    """FLUX.1's VAE layout: 16 latent channels, no quant convs, a shift and a scale in its config (measured on the
    trained encoder's latents by the training script); SD's four blocks, so 64x64 images give 8x8 latents (16
    tokens once packed). Widths as the SD1.5 micro-model's VAE."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=[32, 64, 64, 64], in_channels=3, out_channels=3,
                         down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                         latent_channels=FLUX_LATENT_CHANNELS, norm_num_groups=8, layers_per_block=1, sample_size=64,
                         use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0, scaling_factor=1.0)


def flux_transformer():
    """FLUX.1's FluxTransformer2DModel, double-stream blocks then single-stream blocks, at small widths. No guidance
    embedding (FLUX.1-schnell's layout): the pipeline guides with true CFG against an empty prompt."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=FLUX_LATENT_CHANNELS * 4, num_layers=2, num_single_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=TEXT_HIDDEN, pooled_projection_dim=TEXT_HIDDEN,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12))


def flux_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev's: the shift follows the image's token count (16 tokens here: a shift of about 1.6)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5,
                                           max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def write_micro_model(family: str, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """The shipped micro-model of `family` as a diffusers folder at `out_dir`, weights upcast to fp32; written to
    a temporary sibling and renamed (an interrupted run leaves no half model)."""
    import torch
    from diffusers import DiffusionPipeline

    from .quiet import quiet_libraries
    from .tiny import MARKER_FILE, _check_replaceable

    if family not in micro_families():
        raise ConfigError(f"no micro-model of family {family!r}; trained ones: {', '.join(micro_families())}")
    source = DATA / family
    if not (source / "model_index.json").is_file():
        raise ConfigError(f"{source} holds no micro-model: train it with scripts/train_micro.py --family {family}")
    out = Path(out_dir)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ConfigError(f"{out} already exists (use --overwrite to replace it)")
        _check_replaceable(out)
    quiet_libraries()
    pipe = DiffusionPipeline.from_pretrained(source, dtype=torch.float32)
    with staged_folder(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        extras = {"controlnet": None, "lora": None}
        if (source / "controlnet" / "config.json").is_file():
            from diffusers import ControlNetModel

            ControlNetModel.from_pretrained(source / "controlnet", dtype=torch.float32).save_pretrained(
                tmp / "controlnet", safe_serialization=True)
            extras["controlnet"] = "controlnet"
        if (source / LORA_FILE).is_file():
            from safetensors.torch import load_file, save_file

            (tmp / LORA_FILE).parent.mkdir()
            save_file({k: v.float() for k, v in load_file(source / LORA_FILE).items()}, tmp / LORA_FILE)
            extras["lora"] = LORA_FILE
        record = json.loads((source / TRAINING_RECORD).read_text())
        shutil.copyfile(source / TRAINING_RECORD, tmp / TRAINING_RECORD)
        (tmp / MARKER_FILE).write_text(json.dumps({"family": family, "micro": True, "seed": record.get("seed"),
                                                   **extras}, indent=2))
    return out
