"""Stable Diffusion 1.5: a CLIP encoder, a UNet with classic CFG, an 8× VAE; ControlNet and DeepCache."""

from .base import CfgKind, FamilyInfo, TextEncoding
from .base import Component as C

# The noise-prediction schedulers (runtime/schedulers.py) the UNet families run beside their folder's own
UNET_SCHEDULERS = ("euler", "euler_a", "dpmpp_2m_karras", "ddim", "unipc")

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
    text_encoding=TextEncoding.clip,
    schedulers=UNET_SCHEDULERS,
    # fitted on decoded images (ComfyUI's latent_formats)
    latent_rgb=(((0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721),
                 (-0.2120, -0.2616, -0.7177)), (0.0, 0.0, 0.0)),
    single_file_keys=("model.diffusion_model.input_blocks.0.0.weight", "cond_stage_model.transformer."),
    single_file_convert=True,
    micro_model=True,
    tiny_builder="trt_diffusion.models.tiny:build_tiny_sd15",
    tiny_variants=("inpaint",),  # the 9-channel inpainting UNet
    tiny_full_size=True,  # the real UNet; text encoder and VAE stay tiny, with the hidden sizes the UNet reads
    loop="trt_diffusion.runtime.unet_loop:UnetFamilyLoop",
)
