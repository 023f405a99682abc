"""Z-Image and Z-Image-Turbo (one family: the same `ZImagePipeline`, transformer and folder layout; Turbo is the
step-distilled checkpoint its requests run with 8 steps and guidance 0, so no CFG): a Qwen3 language-model
encoder (`hidden_states[-2]` of the positions its mask keeps), a single-stream DiT that patchifies the latents
itself, and a FLUX.1-style 16-channel AutoencoderKL.

How the engines take ZImagePipeline's unpadded prompts: the pipeline hands the transformer a list of per-prompt
embeddings (each its own length) and, with CFG, the prompt's and the negative prompt's lists concatenated into one
call. The transformer engine takes them padded to the longest with a 1/0 mask over a `text_length` profile (the
`text` axis), and the graph pads each row to its own multiple of 32 as the model does (components/z_image.py): so
CFG is classic — the prompt's and the negative prompt's rows in one call (`cfg: batched`, diffusers' own call,
the default) or in two (`split`).
"""

from .base import WIDE_FLOAT, CfgKind, FamilyInfo, RequestInput
from .base import Component as C

# ZImagePipeline's max_sequence_length default: the chat-templated prompt is padded (for the encoder) and cut to it
Z_IMAGE_TEXT_LENGTH = 512

DECLARATION = FamilyInfo(
    components=(C.text_encoder, C.transformer, C.vae_decoder),
    default_components=(C.text_encoder, C.transformer, C.vae_decoder),
    latent_factor=16,  # the VAE's 8 × the transformer's 2×2 patches
    denoiser=C.transformer,
    # the transformer's prompt tokens (template included): 2 at least (torch.export specializes 0 and 1), up to
    # max_sequence_length; the encoder always sees the 512 padded positions (`padded_text_length`)
    text_lengths=(2, 128, Z_IMAGE_TEXT_LENGTH),
    cfg_kind=CfgKind.batched,  # one call over the prompt's and the negative prompt's rows, as ZImagePipeline makes it
    default_precision={C.transformer: WIDE_FLOAT},  # a bf16-trained DiT: fp16 activations overflow
    pipeline_classes=("ZImagePipeline",),
    workflows=("txt2img",),  # ZImageImg2ImgPipeline / inpaint / ControlNet / Omni are out of this round
    lora_text_encoders=(),  # ZImageLoraLoaderMixin: _lora_loadable_modules = ["transformer"]
    # the released folders save a Qwen3Model (the decoder stack: all of it is the engine); a Qwen3ForCausalLM folder's
    # LM head is not. Not a `language_model_encoder` yet (with `encoder_tokens` naming components/z_image.py's
    # tokens it would be; its encoder's quantization is untested): the transformer is what quantizes
    engine_parts={C.text_encoder: ("embed_tokens.", "layers.", "norm.", "model.embed_tokens.", "model.layers.",
                                   "model.norm.")},
    flow_matching=True,
    # ZImagePipeline's defaults (Z-Image-Turbo's requests set guidance 0 and 8 steps)
    reference_guidance={"guidance_scale": 5.0},
    padded_text_length=Z_IMAGE_TEXT_LENGTH,
    # the timestep and caption embedders, the patch embedder and every adaptive-norm modulation linear
    quantize_exclude=("t_embedder", "cap_embedder", "all_x_embedder", "all_final_layer", "*adaLN_modulation*"),
    no_ensemble="its prompt states carry a mask and a text length per prompt",
    quantize_calls="trt_diffusion.components.z_image:ZImageCalls",  # ZImagePipeline calls it with lists
    tiny_builder="trt_diffusion.models.tiny_z_image:build_tiny_z_image",
    loop="trt_diffusion.runtime.z_image_loop:ZImageFamilyLoop",
    # ZImagePipeline's two CFG arguments, at its defaults where a request leaves them out (CFG_NORMALIZATION,
    # CFG_TRUNCATION on the wire; without CFG, guidance 0, they change nothing)
    request_inputs=(
        RequestInput("cfg_normalization", float, default=0.0, minimum=0.0, maximum=100.0,
                     words="caps the guided prediction's norm at this many times the prompt's prediction's, per "
                           "image and step (diffusers' cfg_normalization; 0, its False: off; 1, its True)"),
        RequestInput("cfg_truncation", float, default=1.0, minimum=0.0, maximum=100.0,
                     words="guidance 0 (the prompt's prediction alone) at the steps whose normalized time "
                           "(1000 - t) / 1000 is above it (diffusers' cfg_truncation; 1 or more: never)"),
    ),
)
