"""A tiny seeded Z-Image pipeline (`ZImagePipeline`: Z-Image and the few-step Z-Image-Turbo share it), and the
released transformer's architecture on the meta device.

The same contract as `tiny.py`: a complete diffusers folder the pipeline class loads, weights from a fixed seed.

ZImagePipeline encodes the prompt with a Qwen3 language model (its `hidden_states[-2]`, the positions the attention
mask keeps) under Qwen3's chat template with `enable_thinking=True`; the released folders save the bare decoder
stack (`Qwen3Model`, no LM head), and so does the tiny one: a narrow Qwen3Model with the offline Qwen2 tokenizer of
the FLUX.2 Klein folder (its template handles `enable_thinking`). The VAE is a
FLUX.1-style `AutoencoderKL` with 16 latent channels and FLUX's scaling and shift factors.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

TEXT_HIDDEN = 16  # the tiny encoder's width: the transformer's cap_feat_dim
TEXT_LAYERS = 2  # ZImagePipeline takes hidden_states[-2]: the first layer's output here

# Tongyi-MAI/Z-Image-Turbo transformer/config.json (diffusers' defaults are the released values)
Z_IMAGE_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                           n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                           cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48),
                           axes_lens=(1536, 512, 512))
TINY_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=1,
                        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
                        cap_feat_dim=TEXT_HIDDEN, rope_theta=256.0, t_scale=1000.0, axes_dims=(4, 6, 6),
                        axes_lens=(1536, 512, 512))
# Tongyi-MAI/Z-Image-Turbo text_encoder/config.json: Qwen3-4B (tied embeddings), saved as a Qwen3Model
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)
# black-forest-labs/FLUX.1-dev vae/config.json (Z-Image ships that VAE)
FLUX_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                use_quant_conv=False, use_post_quant_conv=False)
# Z-Image-Turbo scheduler/scheduler_config.json: a fixed shift (ZImagePipeline still passes mu; unused here)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# FLUX.1's VAE factors (Z-Image reuses that VAE)
VAE_FACTORS = dict(scaling_factor=0.3611, shift_factor=0.1159)


def z_image_transformer(size: str = "tiny"):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(**(Z_IMAGE_TRANSFORMER if size == "full" else TINY_TRANSFORMER))


def meta_parameter_count() -> int:
    """The released transformer's parameter count, built on the meta device (no memory)."""
    return released_parameter_counts()["transformer"]


def released_parameter_counts() -> dict[str, int]:
    """Each engine's parameters in the released checkpoint, its modules built from the configs above on the meta
    device (no memory): the transformer, the text encoder (the whole saved Qwen3Model: its engine), the VAE's
    encoder and decoder halves."""
    from diffusers import AutoencoderKL
    from transformers import Qwen3Config, Qwen3Model

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        vae = AutoencoderKL(**FLUX_VAE, **VAE_FACTORS)
        return {"transformer": count(z_image_transformer("full")),
                "text_encoder": count(Qwen3Model(Qwen3Config(**QWEN3_4B))),
                "vae_encoder": count(vae.encoder) + count(vae.quant_conv or torch.nn.Identity()),
                "vae_decoder": count(vae.decoder) + count(vae.post_quant_conv or torch.nn.Identity())}


def z_image_vae():
    from diffusers import AutoencoderKL

    # four blocks: the released 8x spatial factor; 16 latent channels as the released VAE, tiny widths
    return AutoencoderKL(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16,
                         norm_num_groups=4, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False, use_post_quant_conv=False,
                         **VAE_FACTORS)


def build_tiny_z_image(seed: int = 0, size: str = "tiny", variant: str | None = None):
    """A seeded ZImagePipeline. Z-Image-Turbo is the same pipeline and architecture (its requests differ: 8 steps,
    guidance 0), so there is no separate variant; `size="full"` is refused (a 6B transformer beside a 4B encoder)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from transformers import Qwen3Config, Qwen3Model

    from .tiny_flux2 import qwen3_tokenizer

    if variant is not None:
        raise ConfigError(f"no tiny z_image model of variant {variant!r} (it has none: Z-Image-Turbo is the same "
                          f"pipeline, run with 8 steps and guidance 0)")
    if size != "tiny":
        raise ConfigError(f"--size full: the Z-Image transformer has {meta_parameter_count() / 1e9:.1f}B parameters "
                          f"(checked on the meta device); export the released checkpoint (Tongyi-MAI/Z-Image-Turbo) "
                          f"on a host that holds it")
    torch.manual_seed(seed)
    tokenizer = qwen3_tokenizer()
    encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=24,
                                     num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=TEXT_HIDDEN // 2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                     rope_theta=1_000_000.0, tie_word_embeddings=True,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=z_image_vae(),
                          text_encoder=encoder, tokenizer=tokenizer, transformer=z_image_transformer())


def released_weight_bytes() -> dict[str, dict[str, int]]:
    """Each engine's weight bytes per precision (parameters × the precision's bytes per parameter), from
    `released_parameter_counts`: docs/z-image.md's table. Quantized precisions only where the family quantizes
    the component (the transformer)."""
    from ..families import Component, quantized_component
    from ..precision import Precision

    table = {}
    for component, count in released_parameter_counts().items():
        precisions = [p for p in Precision if not p.is_quantized or quantized_component("z_image", Component(component))]
        table[component] = {p.value: int(count * p.bytes_per_parameter) for p in precisions}
    return table
