"""Tiny, seeded reference pipelines for every family: the embedded default and the test fixtures.

Each writes a complete diffusers folder (model_index.json, scheduler, tokenizers, text encoders,
denoiser, VAE) that `DiffusionPipeline.from_pretrained` loads. Weights come from a fixed seed, so two
processes write identical files. `size="full"` keeps the real architecture (random weights) for honest
benchmarks of real shapes where the family's declaration says so (`tiny_full_size`): SD1.5's and SDXL's UNets
(text encoders and VAE stay tiny, with the real hidden sizes the UNet reads), Wan's 1.3B transformer; Qwen-Image's
(the released 20B transformer), FLUX.2 dev's (32B) and Klein's (3.9B) are checked on the meta device and refused
where the machine cannot hold their weights; SD3 and FLUX.1 would be tens of GB. Which builder makes a family's
folder, and its checkpoint variants, are its declaration's (`tiny_builder`, `tiny_variants`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import ConfigError
from ..families import FAMILIES, Family, declared_code, family_info, family_of_pipeline_class
from ..workspace.files import staged_folder
from .quiet import quiet_libraries

FLUX_LATENT_CHANNELS = 4  # the tiny FLUX VAE's (the real one has 16)
VAE_BLOCK_OUT_CHANNELS = [8, 8, 16, 16]  # four blocks: the real 8x spatial factor, tiny channel counts
# Shards of at most this size: safetensors copies a shard into memory to write it, and a full-size SDXL UNet
# (10 GB) written in one piece would need twice its size.
SHARD_SIZE = "2GB"
TOKENIZER_MAX_LENGTH = 77
T5_MAX_LENGTH = 32  # tiny T5 sequence: keeps DiT tests fast; real models use 256 (SD3) / 512 (FLUX)


def _clip_tokenizer():
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # A byte-level BPE vocabulary with no merges: every byte is a token, like CLIP before training.
    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=TOKENIZER_MAX_LENGTH)


def _t5_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(chr(i), -2.0) for i in range(32, 127)]
    pieces += [("\u2581" + chr(i), -1.0) for i in range(97, 123)]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        extra_ids=0, model_max_length=T5_MAX_LENGTH,
    )


def _clip_text_encoder(hidden: int = 32, projection: bool = False, projection_dim: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=512, eos_token_id=513, pad_token_id=513, hidden_size=hidden, intermediate_size=37,
        layer_norm_eps=1e-5, num_attention_heads=4, num_hidden_layers=2, vocab_size=1000,
        projection_dim=projection_dim, hidden_act="gelu",
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _t5_encoder(d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        d_model=d_model, d_ff=37, d_kv=8, num_heads=4, num_layers=2, vocab_size=1000,
        relative_attention_num_buckets=8, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
    )
    # eager attention: the dynamo exporter cannot trace T5's sdpa path
    config._attn_implementation = "eager"
    return T5EncoderModel(config)


def _vae(latent_channels: int, size: str = "tiny", **extra):
    from diffusers import AutoencoderKL

    if size == "full":  # the SD1.5/SDXL VAE's architecture (84M parameters): what img2img encodes with
        return AutoencoderKL(
            block_out_channels=[128, 256, 512, 512], in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            latent_channels=latent_channels, layers_per_block=2, sample_size=512, **extra,
        )
    return AutoencoderKL(
        block_out_channels=VAE_BLOCK_OUT_CHANNELS, in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=latent_channels, norm_num_groups=4, layers_per_block=1, sample_size=64, **extra,
    )


def _sd15_unet(size: str, in_channels: int = 4):
    from diffusers import UNet2DConditionModel

    if size == "full":  # runwayml/stable-diffusion-v1-5's UNet config (860M parameters)
        return UNet2DConditionModel(sample_size=64, cross_attention_dim=768, in_channels=in_channels)
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=in_channels, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=4, attention_head_dim=4,
    )


def _sdxl_unet(size: str, in_channels: int = 4):
    from diffusers import UNet2DConditionModel

    if size == "full":  # stabilityai/stable-diffusion-xl-base-1.0's UNet config (2.57B parameters)
        return UNet2DConditionModel(
            sample_size=128, in_channels=in_channels, block_out_channels=(320, 640, 1280), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
            cross_attention_dim=2048, addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,  # pooled text_embeds (1280) + 6 time ids x 256
        )
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=in_channels, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=32 + 6 * 8,  # pooled text_embeds (32) + 6 time ids x 8
        cross_attention_dim=64, norm_num_groups=4,
    )


def _controlnet(unet):
    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(4, 8, 8, 8))
    # Fresh ControlNets end in zero convolutions and output exact zeros: parity would pass trivially.
    with torch.no_grad():
        for module in [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block]:
            for p in module.parameters():
                p.normal_(0.0, 0.05)
    return controlnet


def _euler_scheduler():
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        steps_offset=1, timestep_spacing="leading",
    )


def build_tiny_pipeline(family: Family | str, seed: int = 0, size: str = "tiny", variant: str | None = None):
    """Build (in memory) a seeded pipeline of the family: its declaration's `tiny_builder`, then every parameter
    perturbed. `variant`: one of the declaration's `tiny_variants` (None: text-to-image)."""
    quiet_libraries()
    family = Family(family)
    info = family_info(family)
    if variant is not None and variant not in info.tiny_variants:
        known = "; ".join(f"{v}: {', '.join(f.value for f, i in FAMILIES.items() if v in i.tiny_variants)}"
                          for v in dict.fromkeys(v for i in FAMILIES.values() for v in i.tiny_variants))
        raise ConfigError(f"no tiny {family.value} model of variant {variant!r} (variants: {known})")
    if size not in ("tiny", "full"):
        raise ConfigError(f"--size must be 'tiny' or 'full', got {size!r}")
    if size == "full" and not info.tiny_full_size:
        full = ", ".join(f.value for f, i in FAMILIES.items() if i.tiny_full_size)
        raise ConfigError(f"--size full is available for {full} only (got --family {family.value})")
    pipe = declared_code(info.tiny_builder)(seed, size, variant)
    _perturb_all_parameters(pipe, seed)
    return pipe


def build_tiny_sd15(seed: int, size: str, variant: str | None):
    import diffusers

    torch.manual_seed(seed)
    scheduler = _euler_scheduler()
    inpaint = variant == "inpaint"
    text_hidden = 768 if size == "full" else 32
    parts = dict(unet=_sd15_unet(size, 9 if inpaint else 4), vae=_vae(4, size),
                 text_encoder=_clip_text_encoder(text_hidden), tokenizer=_clip_tokenizer(), scheduler=scheduler,
                 safety_checker=None, feature_extractor=None, image_encoder=None)
    pipe_cls = diffusers.StableDiffusionInpaintPipeline if inpaint else diffusers.StableDiffusionPipeline
    return pipe_cls(**parts, requires_safety_checker=False)


def build_tiny_sdxl(seed: int, size: str, variant: str | None):
    import diffusers

    torch.manual_seed(seed)
    scheduler = _euler_scheduler()
    inpaint = variant == "inpaint"
    # full: CLIP-L (768) and OpenCLIP-G (1280, projected to 1280) hidden sizes, the 2048 the UNet attends to
    hidden, hidden_2 = (768, 1280) if size == "full" else (32, 32)
    pipe_cls = diffusers.StableDiffusionXLInpaintPipeline if inpaint else diffusers.StableDiffusionXLPipeline
    return pipe_cls(
        unet=_sdxl_unet(size, 9 if inpaint else 4), vae=_vae(4, size), text_encoder=_clip_text_encoder(hidden),
        text_encoder_2=_clip_text_encoder(hidden_2, projection=True, projection_dim=hidden_2),
        tokenizer=_clip_tokenizer(),
        tokenizer_2=_clip_tokenizer(), scheduler=scheduler, image_encoder=None, feature_extractor=None,
    )


def build_tiny_sd3(seed: int, size: str, variant: str | None):
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    transformer = diffusers.SD3Transformer2DModel(
        # 16 latent channels as SD3's VAE has (diffusers' SD3 inpaint pipeline accepts 16 or 33 only)
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=64, pooled_projection_dim=64,
        pos_embed_max_size=32,
    )
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer, vae=_vae(16, shift_factor=0.0609, scaling_factor=1.5035,
                                        use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=_clip_text_encoder(32, projection=True), text_encoder_2=_clip_text_encoder(32, projection=True),
        text_encoder_3=_t5_encoder(64), tokenizer=_clip_tokenizer(), tokenizer_2=_clip_tokenizer(),
        tokenizer_3=_t5_tokenizer(), scheduler=scheduler,
    )


def build_tiny_flux(seed: int, size: str, variant: str | None):
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096)
    packed = FLUX_LATENT_CHANNELS * 4  # 2x2 latent pixels per token
    channels = {"in_channels": packed}
    if variant == "fill":  # FluxFillPipeline's input: latents, masked-image latents, the mask per 8x8 pixels
        vae_scale = 2 ** (len(VAE_BLOCK_OUT_CHANNELS) - 1)
        channels = dict(in_channels=2 * packed + 4 * vae_scale * vae_scale, out_channels=packed)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
        guidance_embeds=True, **channels,
    )
    pipe_cls = {"fill": diffusers.FluxFillPipeline, "kontext": diffusers.FluxKontextPipeline}.get(
        variant, diffusers.FluxPipeline)
    return pipe_cls(
        transformer=transformer, vae=_vae(FLUX_LATENT_CHANNELS, shift_factor=0.1159, scaling_factor=0.3611,
                                        use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=_clip_text_encoder(32), text_encoder_2=_t5_encoder(32), tokenizer=_clip_tokenizer(),
        tokenizer_2=_t5_tokenizer(), scheduler=scheduler,
    )


def build_tiny_flux2(seed: int, size: str, variant: str | None):
    from .tiny_flux2 import build_tiny_flux2 as build

    return build(seed, size, variant)  # size full: refused where the machine cannot hold it


def build_tiny_flux2_klein(seed: int, size: str, variant: str | None):
    from .tiny_flux2 import build_tiny_flux2 as build

    return build(seed, size, variant, klein=True)


def _perturb_all_parameters(pipe, seed: int) -> None:
    """Give every parameter its own random offset.

    Random init leaves many identical tensors (all-ones norms, zero biases) that exporters deduplicate;
    refit maps and parity tests need every weight distinct and non-trivial.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    for name, component in sorted(pipe.components.items()):
        if not isinstance(component, torch.nn.Module):
            continue
        with torch.no_grad():
            for _, param in sorted(component.named_parameters()):
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.add_(noise.to(param.dtype) * 0.02)
        component.eval()


def build_tiny_controlnet(family: Family | str, unet, seed: int = 0):
    family = Family(family)
    if not family_info(family).supports_controlnet:
        supported = " and ".join(f.value for f, info in FAMILIES.items() if info.supports_controlnet)
        raise ConfigError(f"ControlNet is supported for {supported}, not {family.value}")
    torch.manual_seed(seed + 100)
    controlnet = _controlnet(unet)
    _perturb_module(controlnet, seed + 101)
    return controlnet.eval()


def _perturb_module(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)


LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the attention projections (FamilyInfo.tiny_lora_targets)


def build_tiny_lora(pipe, seed: int = 0, rank: int = 4):
    """A LoRA on the denoiser's attention projections (Wan: every linear layer of its attention blocks, as its
    trainers make them), initialised randomly so it changes outputs.

    Returns the PEFT state dict in diffusers naming (what `save_lora_weights` writes). A two-expert Wan model's
    LoRA is the `transformer`'s (the high-noise expert: where diffusers' `load_lora_weights` loads it).
    """
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    torch.manual_seed(seed + 200)
    family = family_of_pipeline_class(type(pipe).__name__)
    # the declaration's (Wan's: every linear layer of its attention blocks); a class no family claims: attention's
    targets = list(family_info(family).tiny_lora_targets) if family is not None else LORA_TARGETS
    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=targets)
    denoiser.add_adapter(config, adapter_name="tiny")
    state = get_peft_model_state_dict(denoiser, adapter_name="tiny")
    denoiser.delete_adapters("tiny")
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


MARKER_FILE = "trt_diffusion_tiny.json"


def _check_replaceable(out: Path) -> None:
    """`--overwrite` deletes `out`: only a tiny model folder this tool wrote, never a place that holds
    the working directory or the home folder."""
    if out.is_symlink():
        raise ConfigError(f"{out} is a symbolic link; --overwrite replaces only a folder `models tiny` wrote")
    resolved = out.resolve()
    for protected in (Path.cwd().resolve(), Path.home().resolve()):
        if resolved == protected or resolved in protected.parents:
            raise ConfigError(f"refusing to overwrite {out}: it is (or holds) the working directory or the home "
                              "folder; choose another --out")
    if not out.is_dir() or not (out / MARKER_FILE).is_file():
        raise ConfigError(f"refusing to overwrite {out}: it was not written by `trt-diffusion models tiny` "
                          f"(no {MARKER_FILE}); choose another --out or remove it yourself")


def write_tiny_model(
    out_dir: str | os.PathLike, family: Family | str, *, seed: int = 0, size: str = "tiny",
    controlnet: bool = False, lora: bool = False, overwrite: bool = False, variant: str | None = None,
) -> Path:
    """Write a complete diffusers folder (plus `controlnet/` and `lora/` sub-folders when asked).

    Written to a temporary sibling and renamed, so an interrupted run leaves no half model.
    """
    out = Path(out_dir)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ConfigError(f"{out} already exists (use --overwrite to replace it)")
        _check_replaceable(out)
    family = Family(family)
    pipe = build_tiny_pipeline(family, seed=seed, size=size, variant=variant)
    with staged_folder(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True, max_shard_size=SHARD_SIZE)
        if variant == "edit":
            from .tiny_qwen import fix_processor_entry

            fix_processor_entry(tmp)
        extras = {"family": family.value, "seed": seed, "size": size, "variant": variant, "controlnet": None,
                  "lora": None}
        if controlnet:
            denoiser = pipe.unet if family_info(family).supports_controlnet else None
            if denoiser is None:
                raise ConfigError(f"--controlnet: the {family.value} family has no ControlNet in trt-diffusion")
            build_tiny_controlnet(family, denoiser, seed).save_pretrained(tmp / "controlnet")
            extras["controlnet"] = "controlnet"
        if lora:
            state = build_tiny_lora(pipe, seed)
            lora_dir = tmp / "lora"
            lora_dir.mkdir()
            pipe_cls = type(pipe)
            key = "unet_lora_layers" if hasattr(pipe, "unet") else "transformer_lora_layers"
            pipe_cls.save_lora_weights(lora_dir, **{key: state}, safe_serialization=True)
            extras["lora"] = "lora/pytorch_lora_weights.safetensors"
        (tmp / MARKER_FILE).write_text(json.dumps(extras, indent=2))
    return out
