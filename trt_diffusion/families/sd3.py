"""Stable Diffusion 3: two CLIP encoders and a T5, an MMDiT with classic CFG, flow matching."""

from .base import CfgKind, FamilyInfo, TextEncoding
from .base import Component as C

DECLARATION = FamilyInfo(
    components=(C.text_encoder, C.text_encoder_2, C.text_encoder_3, C.transformer, C.vae_encoder, C.vae_decoder),
    default_components=(C.text_encoder, C.text_encoder_2, C.text_encoder_3, C.transformer, C.vae_decoder),
    latent_factor=16,
    denoiser=C.transformer,
    cfg_kind=CfgKind.batched,
    pipeline_classes=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    workflows=("txt2img", "img2img", "inpaint"),
    lora_text_encoders=(C.text_encoder, C.text_encoder_2),  # T5 parts are not loaded by diffusers: refused by name
    flow_matching=True,
    reference_guidance={"guidance_scale": 7.0},
    long_tokenizer="tokenizer_3",
    denoiser_tokenizers=("tokenizer", "tokenizer_3"),  # CLIP-L/G embeddings then T5's, along the sequence
    text_encoding=TextEncoding.clip_pair_t5,
    schedulers=("flow_euler",),
    tiny_builder="trt_diffusion.models.tiny:build_tiny_sd3",  # full size would be tens of GB
    loop="trt_diffusion.runtime.unet_loop:UnetFamilyLoop",
)
