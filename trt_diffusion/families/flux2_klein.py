"""FLUX.2 Klein: FLUX.2's transformer and VAE with a Qwen3 encoder and true CFG (two calls per step)."""

from .base import CfgKind, FamilyInfo
from .base import Component as C
from .flux2 import FLUX2_TEXT_LENGTH
from .qwen_image import DECODER_STACK

DECLARATION = FamilyInfo(
    components=(C.text_encoder, C.transformer, C.vae_decoder),
    default_components=(C.text_encoder, C.transformer, C.vae_decoder),
    latent_factor=16,
    denoiser=C.transformer,
    cfg_kind=CfgKind.true_cfg,  # Flux2KleinPipeline's true CFG: the prompt's call, then the negative prompt's
    pipeline_classes=("Flux2KleinPipeline",),
    workflows=("txt2img",),  # Klein's inpainting is out of this round
    lora_text_encoders=(),
    language_model_encoder=True,
    encoder_tokens="trt_diffusion.components.flux2:encoder_tokens",
    text_layers=(9, 18, 27),
    engine_parts={C.text_encoder: DECODER_STACK},  # a Qwen3 with its LM head: the engine is the decoder stack
    flow_matching=True,
    packed_latents=True,
    reference_guidance={"guidance_scale": 4.0},
    padded_text_length=FLUX2_TEXT_LENGTH,
    quantize_exclude=("time_guidance_embed", "*modulation*"),
    no_ensemble="the stages' tensors are the CLIP/T5 families' encodings",
    quantize_layout="trt_diffusion.quantize.feeds:flux2_layout",
    trace_patches="trt_diffusion.quantize.trace_patches:flux2_strided_rotary",
    tiny_builder="trt_diffusion.models.tiny:build_tiny_flux2_klein",
    tiny_full_size=True,  # checked on the meta device, refused where the machine cannot hold it
    loop="trt_diffusion.runtime.family_loops:Flux2FamilyLoop",
)
