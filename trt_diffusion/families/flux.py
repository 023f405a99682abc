"""FLUX.1: a CLIP and a T5 encoder, a DiT with embedded guidance (FluxPipeline runs no CFG), flow matching;
img2img, inpaint (and Fill), Kontext editing, first-block step caching."""

from .base import WIDE_FLOAT, CfgKind, EditKind, FamilyInfo, TextEncoding
from .base import Component as C

DECLARATION = FamilyInfo(
    components=(C.text_encoder, C.text_encoder_2, C.transformer, C.vae_encoder, C.vae_decoder),
    default_components=(C.text_encoder, C.text_encoder_2, C.transformer, C.vae_decoder),
    latent_factor=16,
    denoiser=C.transformer,
    # FLUX.1's guidance is an embedding of the transformer: one call per step
    cfg_kind=CfgKind.embedded,
    default_precision={C.transformer: WIDE_FLOAT},  # fp16 fails parity (0.037 > 0.02 on the tiny model)
    pipeline_classes=("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline",
                      "FluxKontextPipeline", "FluxControlPipeline"),
    workflows=("txt2img", "img2img", "inpaint", "edit"),
    edit=EditKind.context_tokens,
    lora_text_encoders=(C.text_encoder,),
    flow_matching=True,
    packed_latents=True,
    reference_guidance={"guidance_scale": 3.5},
    long_tokenizer="tokenizer_2",
    denoiser_tokenizers=("tokenizer_2",),  # T5 only
    step_cache=("first_block",),  # the first double-stream block's residual predicts the rest
    # the legacy exporter bakes its rotary-embedding reshapes at the traced token count: quantized graphs are static
    static_trace=True,
    text_encoding=TextEncoding.clip_t5,
    schedulers=("flow_euler",),
    micro_model=True,
    tiny_builder="trt_diffusion.models.tiny:build_tiny_flux",
    tiny_variants=("fill", "kontext"),
    loop="trt_diffusion.runtime.family_loops:FluxFamilyLoop",
)
