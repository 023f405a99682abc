"""Stable Diffusion XL: two CLIP encoders, a UNet with `text_time` conditioning and classic CFG; ControlNet and
DeepCache."""

from .base import CfgKind, FamilyInfo, TextEncoding
from .base import Component as C
from .sd15 import UNET_SCHEDULERS

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
    text_encoding=TextEncoding.clip_pair,
    schedulers=UNET_SCHEDULERS,
    latent_rgb=(((0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362),
                 (-0.3165, -0.2492, -0.2188)), (0.1084, -0.0175, -0.0011)),
    single_file_keys=("model.diffusion_model.input_blocks.0.0.weight", "conditioner.embedders.1.model."),
    tiny_builder="trt_diffusion.models.tiny:build_tiny_sdxl",
    tiny_variants=("inpaint",),
    tiny_full_size=True,
    loop="trt_diffusion.runtime.unet_loop:UnetFamilyLoop",
)
