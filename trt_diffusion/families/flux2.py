"""FLUX.2 dev: a Mistral-3 language-model encoder whose hidden states are stacked at fixed layers, a DiT with
embedded guidance (one call per step), a VAE decoder with the batch-norm denormalization in its graph."""

from .base import CfgKind, FamilyInfo
from .base import Component as C
from .qwen_image import DECODER_STACK

# Flux2Pipeline and Flux2KleinPipeline pad every prompt (after the chat template) to max_sequence_length, 512 by
# default, and stack the encoder's hidden states at their text_encoder_out_layers
FLUX2_TEXT_LENGTH = 512

DECLARATION = FamilyInfo(
    components=(C.text_encoder, C.transformer, C.vae_decoder),
    default_components=(C.text_encoder, C.transformer, C.vae_decoder),
    latent_factor=16,  # the VAE's 8 × the 2×2 patchified latents
    denoiser=C.transformer,
    cfg_kind=CfgKind.embedded,  # guidance is an input of the transformer: one call per step
    pipeline_classes=("Flux2Pipeline",),
    # FLUX.2's reference-image editing is out of this round: text-to-image only
    workflows=("txt2img",),
    lora_text_encoders=(),  # Flux2LoraLoaderMixin: the transformer only
    language_model_encoder=True,
    encoder_tokens="trt_diffusion.components.flux2:encoder_tokens",
    text_layers=(10, 20, 30),
    # the folder is the whole Mistral-3 (Pixtral vision tower, projector, LM head): the engine is the decoder stack
    engine_parts={C.text_encoder: (*DECODER_STACK, "language_model.model.")},  # + transformers 4's Mistral3 layout
    flow_matching=True,
    packed_latents=True,
    reference_guidance={"guidance_scale": 4.0},
    padded_text_length=FLUX2_TEXT_LENGTH,
    quantize_exclude=("time_guidance_embed", "*modulation*"),
    no_ensemble="the stages' tensors are the CLIP/T5 families' encodings",
    quantize_layout="trt_diffusion.quantize.feeds:flux2_layout",
    trace_patches="trt_diffusion.quantize.trace_patches:flux2_strided_rotary",
    system_message=True,
    tiny_builder="trt_diffusion.models.tiny:build_tiny_flux2",
    tiny_full_size=True,  # checked on the meta device, refused where the machine cannot hold it
    loop="trt_diffusion.runtime.family_loops:Flux2FamilyLoop",
)
