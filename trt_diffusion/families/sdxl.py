"""Stable Diffusion XL: two CLIP encoders, a UNet with `text_time` conditioning and classic CFG; ControlNet and
DeepCache."""

from .base import CfgKind, FamilyInfo
from .base import Component as C

DECLARATION = FamilyInfo(
    components=(C.text_encoder, C.text_encoder_2, C.unet, C.vae_encoder, C.vae_decoder, C.controlnet),
    default_components=(C.text_encoder, C.text_encoder_2, C.unet, C.vae_decoder),
    latent_factor=8,
    denoiser=C.unet,
    cfg_kind=CfgKind.batched,
    pipeline_classes=("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                      "StableDiffusionXLInpaintPipeline", "StableDiffusionXLControlNetPipeline"),
    workflows=("txt2img", "img2img", "inpaint"),
    lora_text_encoders=(C.text_encoder, C.text_encoder_2),
    step_cache=("deepcache",),
    reference_guidance={"guidance_scale": 5.0},
)
