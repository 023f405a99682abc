"""Tiny seeded Wan 2.x video pipelines (and the full-size Wan 2.1 1.3B transformer architecture).

The same contract as `tiny.py`: a complete diffusers folder `WanPipeline.from_pretrained` loads, weights from a
fixed seed. Variants: None (Wan 2.1 text-to-video), `two_expert` (Wan 2.2 A14B's form: a high-noise
`transformer` and a low-noise `transformer_2`, switched at `boundary_ratio`), and the image-to-video checkpoints
`WanImageToVideoPipeline` loads: `i2v` (Wan 2.1 I2V: a CLIP vision `image_encoder` whose penultimate hidden states
the transformer attends to beside the text) and `i2v_two_expert` (Wan 2.2 I2V A14B: two experts, no image
encoder). Both image-to-video transformers take 36 input channels: the noise (16), the first-frame mask packed per
latent frame (4) and the VAE latents of the conditioning clip (16).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..families import WAN_TEXT_LENGTH

WAN_VARIANTS = ("two_expert", "i2v", "i2v_two_expert")
I2V_CHANNELS = 36  # WanImageToVideoPipeline: latents (16) + mask (temporal factor 4) + condition latents (16)
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
    config._attn_implementation = "eager"  # the dynamo exporter cannot trace T5's sdpa path
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


def wan_transformer(size: str = "tiny", image_to_video: bool = False, image_dim: int | None = None):
    """`image_to_video`: 36 input channels; `image_dim`: Wan 2.1 I2V's image cross-attention (the CLIP width),
    its added key/value projections as wide as the transformer (Wan2.1-I2V-14B's config)."""
    from diffusers import WanTransformer3DModel

    config = dict(WAN_1_3B_TRANSFORMER if size == "full" else TINY_TRANSFORMER)
    if image_to_video:
        config["in_channels"] = I2V_CHANNELS
    if image_dim is not None:
        config.update(image_dim=image_dim, added_kv_proj_dim=config["num_attention_heads"] * config["attention_head_dim"])
    return WanTransformer3DModel(**config)


TINY_CLIP_IMAGE = 28  # the tiny vision tower's input side (ViT-H/14 takes 224): 2x2 patches of 14 + a class token


def _clip_image_encoder():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
                              image_size=TINY_CLIP_IMAGE, patch_size=14, projection_dim=32)
    config._attn_implementation = "eager"
    return CLIPVisionModel(config)


def _clip_image_processor():
    """Wan 2.1 I2V's CLIPImageProcessor (OpenAI CLIP's mean/std, bicubic, centre crop), at the tiny tower's side."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": TINY_CLIP_IMAGE},
                              crop_size={"height": TINY_CLIP_IMAGE, "width": TINY_CLIP_IMAGE})


def build_tiny_wan(seed: int = 0, size: str = "tiny", variant: str | None = None):
    """A seeded WanPipeline. `size="full"`: the Wan 2.1 1.3B transformer (random weights) with the tiny text
    encoder widened to the 4096 features it attends to; the VAE stays tiny."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    if variant is not None and variant not in WAN_VARIANTS:
        raise ConfigError(f"no tiny wan model of variant {variant!r} (variants: {', '.join(WAN_VARIANTS)})")
    if size == "full" and variant is not None:
        raise ConfigError("--size full gives the Wan 2.1 1.3B architecture only (no --variant)")
    torch.manual_seed(seed)
    two_expert = variant in ("two_expert", "i2v_two_expert")
    image_to_video = variant in ("i2v", "i2v_two_expert")
    image_encoder = _clip_image_encoder() if variant == "i2v" else None
    image_dim = image_encoder.config.hidden_size if image_encoder is not None else None

    def expert():
        return wan_transformer(size, image_to_video, image_dim)

    parts = dict(
        tokenizer=_umt5_tokenizer(), text_encoder=_umt5_encoder(4096 if size == "full" else 32), vae=_wan_vae(),
        scheduler=_wan_scheduler(), transformer=expert(), transformer_2=expert() if two_expert else None,
        boundary_ratio=WAN_BOUNDARY_RATIO if two_expert else None,
    )
    if not image_to_video:
        return WanPipeline(**parts)
    return WanImageToVideoPipeline(**parts, image_encoder=image_encoder,
                                   image_processor=_clip_image_processor() if image_encoder is not None else None)


def meta_parameter_count(size: str = "full") -> int:
    """The transformer's parameter count, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in wan_transformer(size).parameters())
