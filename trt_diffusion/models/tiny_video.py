"""Tiny seeded Wan 2.x video pipelines (and the full-size Wan 2.1 1.3B transformer architecture).

The same contract as `tiny.py`: a complete diffusers folder `WanPipeline.from_pretrained` loads, weights from a
fixed seed. Variants: None (Wan 2.1 text-to-video), `two_expert` (Wan 2.2 A14B's form: a high-noise
`transformer` and a low-noise `transformer_2`, switched at `boundary_ratio`).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..families import WAN_TEXT_LENGTH

WAN_VARIANTS = ("two_expert",)
WAN_BOUNDARY_RATIO = 0.875  # Wan 2.2 A14B's model_index.json value
WAN_FLOW_SHIFT = 3.0  # diffusers' Wan docs: 3.0 for 480p, 5.0 for 720p

# Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json)
WAN_1_3B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
    text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
)


def _umt5_encoder(d_model: int = 32):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        d_model=d_model, d_ff=37, d_kv=8, num_heads=4, num_layers=2, vocab_size=1000,
        relative_attention_num_buckets=8, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False,
    )
    config._attn_implementation = "eager"  # the dynamo exporter cannot trace T5's sdpa path (FACTS.md)
    return UMT5EncoderModel(config)


def _umt5_tokenizer():
    from .tiny import _t5_tokenizer

    tokenizer = _t5_tokenizer()
    tokenizer.model_max_length = WAN_TEXT_LENGTH
    return tokenizer


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def _wan_scheduler():
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=WAN_FLOW_SHIFT)


def wan_transformer(size: str = "tiny"):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**(WAN_1_3B_TRANSFORMER if size == "full" else TINY_TRANSFORMER))


def build_tiny_wan(seed: int = 0, size: str = "tiny", variant: str | None = None):
    """A seeded WanPipeline. `size="full"`: the Wan 2.1 1.3B transformer (random weights) with the tiny text
    encoder widened to the 4096 features it attends to; the VAE stays tiny."""
    from diffusers import WanPipeline

    if variant is not None and variant not in WAN_VARIANTS:
        raise ConfigError(f"no tiny wan model of variant {variant!r} (variants: {', '.join(WAN_VARIANTS)})")
    if size == "full" and variant is not None:
        raise ConfigError("--size full gives the Wan 2.1 1.3B architecture only (no --variant)")
    torch.manual_seed(seed)
    two_expert = variant == "two_expert"
    transformer = wan_transformer(size)
    parts = dict(
        tokenizer=_umt5_tokenizer(), text_encoder=_umt5_encoder(4096 if size == "full" else 32), vae=_wan_vae(),
        scheduler=_wan_scheduler(), transformer=transformer,
        transformer_2=wan_transformer(size) if two_expert else None,
        boundary_ratio=WAN_BOUNDARY_RATIO if two_expert else None,
    )
    return WanPipeline(**parts)


def meta_parameter_count(size: str = "full") -> int:
    """The transformer's parameter count, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in wan_transformer(size).parameters())
