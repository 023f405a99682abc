"""Qwen-Image: a Qwen2.5-VL language-model encoder (text length a profile axis), an MMDiT with true CFG, a
Wan-style 3D VAE; img2img, inpaint and Qwen-Image-Edit."""

from .base import CfgKind, EditKind, FamilyInfo
from .base import Component as C

# QwenImagePipeline's prompt handling: its template's system part tokenizes to the first 34 positions
# (prompt_template_encode_start_idx), dropped from the encoder's hidden states; what is left (the prompt and the
# template's 5-token tail) is cut to max_sequence_length, 512 by default
QWEN_TEMPLATE_TOKENS = 34
QWEN_EDIT_TEMPLATE_TOKENS = 64  # QwenImageEditPipeline's prompt_template_encode_start_idx (its longer system part)
# diffusers' QwenImageEditPipeline.prompt_template_encode; its first 64 positions are dropped
QWEN_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n")
QWEN_EDIT_TEMPLATE_PREFIX = QWEN_EDIT_TEMPLATE.split("<|vision_start|>")[0]  # what tokenizes to the 64 dropped
QWEN_TEXT_LENGTH = 512
QWEN_MAX_TEXT_LENGTH = 1024  # QwenImagePipeline refuses a max_sequence_length above it

# A checkpoint folder that holds more than its engine: the text encoder folder is the whole Qwen2.5-VL (vision
# tower, LM head), its engine the language model (both key layouts transformers has saved)
DECODER_STACK = ("model.embed_tokens.", "model.layers.", "model.norm.", "model.language_model.")

DECLARATION = FamilyInfo(
    # vae_encoder serves img2img / inpaint (QwenImageImg2ImgPipeline, QwenImageInpaintPipeline) and edit
    # (QwenImageEditPipeline), whose image_encoder is the text encoder's Qwen2.5-VL vision tower
    components=(C.text_encoder, C.image_encoder, C.transformer, C.vae_encoder, C.vae_decoder),
    default_components=(C.text_encoder, C.transformer, C.vae_decoder),
    latent_factor=16,  # the VAE's 8 × the transformer's 2×2 patches
    denoiser=C.transformer,
    # up to max_sequence_length's default; 2 at least (torch.export specializes 0 and 1), tuned for 128
    text_lengths=(2, 128, 512),
    cfg_kind=CfgKind.true_cfg,  # QwenImagePipeline's true CFG: the prompt's call, then the negative prompt's
    pipeline_classes=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline",
                      "QwenImageEditPipeline"),
    workflows=("txt2img", "img2img", "inpaint", "edit"),
    edit=EditKind.vision_reference,
    lora_text_encoders=(),  # diffusers' QwenImageLoraLoaderMixin: _lora_loadable_modules = ["transformer"]
    language_model_encoder=True,
    encoder_tokens="trt_diffusion.components.qwen_image:encoder_tokens",
    engine_parts={C.text_encoder: DECODER_STACK},
    flow_matching=True,
    packed_latents=True,
    reference_guidance={"true_cfg_scale": 4.0, "negative_prompt": ""},
    # the DiT's input projections and its adaptive-norm modulation linears (per-sample vectors)
    quantize_exclude=("img_in", "txt_in", "*img_mod*", "*txt_mod*"),
    no_ensemble="its prompt states carry a mask and a text length per prompt",
    quantize_layout="trt_diffusion.quantize.feeds:qwen_image_layout",
    trace_patches="trt_diffusion.quantize.trace_patches:real_rotary",
    tiny_builder="trt_diffusion.models.tiny_qwen:build_tiny_qwen_image",
    tiny_variants=("edit",),
    tiny_full_size=True,  # the released 20B transformer, checked on the meta device
    loop="trt_diffusion.runtime.family_loops:QwenImageFamilyLoop",
)
