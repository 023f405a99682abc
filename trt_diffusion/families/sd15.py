"""Stable Diffusion 1.5: a CLIP encoder, a UNet with classic CFG, an 8× VAE; ControlNet and DeepCache."""

from .base import CfgKind, FamilyInfo
from .base import Component as C

DECLARATION = FamilyInfo(
    components=(C.text_encoder, C.unet, C.vae_encoder, C.vae_decoder, C.controlnet),
    default_components=(C.text_encoder, C.unet, C.vae_decoder),
    latent_factor=8,
    denoiser=C.unet,
    cfg_kind=CfgKind.batched,
    pipeline_classes=("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline",
                      "StableDiffusionControlNetPipeline"),
    workflows=("txt2img", "img2img", "inpaint"),
    lora_text_encoders=(C.text_encoder,),
    step_cache=("deepcache",),
    pooled_prompt=False,
    reference_guidance={"guidance_scale": 7.5},  # DeepCache needs a UNet's skip connections
)
