"""Wan 2.1 / 2.2 video: a UMT5 encoder, a 3D transformer (Wan 2.2: two experts), a causal 3D VAE;
text-to-video and image-to-video checkpoints."""

from .base import CfgKind, FamilyInfo
from .base import Component as C

WAN_TEXT_LENGTH = 512  # WanPipeline.__call__'s max_sequence_length default (Wan's own text_len): every prompt is padded to it

DECLARATION = FamilyInfo(
    # image_encoder (Wan 2.1 I2V's CLIP vision tower) and vae_encoder serve image-to-video (workflows.img2vid)
    components=(C.text_encoder, C.image_encoder, C.transformer, C.transformer_2, C.vae_encoder, C.vae_decoder),
    default_components=(C.text_encoder, C.transformer, C.vae_decoder),
    latent_factor=16,  # the 3D VAE's 8 × the transformer's 2×2 spatial patches
    denoiser=C.transformer,
    temporal_factor=4,
    cfg_kind=CfgKind.batched,  # WanPipeline's two batch-1 calls, or one batch-2 call over both
    pipeline_classes=("WanPipeline", "WanImageToVideoPipeline"),
    workflows=("txt2img", "img2vid"),  # a video family's txt2img makes a clip (text-to-video)
    lora_text_encoders=(),  # diffusers' WanLoraLoaderMixin loads the transformer(s) only
    flow_matching=True,
    reference_guidance={"guidance_scale": 5.0},  # Wan 2.2 also gets guidance_scale_2 (quantize/calibration.py)
    padded_text_length=WAN_TEXT_LENGTH,
    # ModelOpt's diffusers example keeps `patch_embedding` (the first layer, a Conv3d) and `condition_embedder` (the
    # time and text embeddings) in higher precision, as conv_in and time/context embedders are kept for all
    quantize_exclude=("patch_embedding", "condition_embedder"),
    no_ensemble="its LATENTS are 4-D",
    trace_patches="trt_diffusion.quantize.trace_patches:functional_rotary",
    schedulers=("unipc", "flow_euler"),  # default: the folder's UniPC (flow_prediction, flow sigmas, flow_shift)
    tiny_builder="trt_diffusion.models.tiny_video:build_tiny_wan",
    tiny_variants=("two_expert", "i2v", "i2v_two_expert"),
    tiny_full_size=True,  # the 1.3B transformer
    # Wan LoRAs are trained on every linear layer of the attention blocks (musubi-tuner's default: self- (attn1) and
    # cross-attention (attn2) projections and the feed-forward (ffn)); diffusers' converter for musubi-tuner files
    # converts only LoRAs that cover all of them
    tiny_lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
    loop="trt_diffusion.runtime.family_loops:WanFamilyLoop",
)
