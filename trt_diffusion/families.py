"""What each model family is made of: its components, latent geometry and ControlNet support.

Pure data, no torch: the spec layer validates engines.yaml against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from .precision import Precision


class Family(str, Enum):
    __str__ = str.__str__  # str() and f-strings give the value ("sd15"), as the plain strings specs held did

    sd15 = "sd15"
    sdxl = "sdxl"
    sd3 = "sd3"
    flux = "flux"
    wan = "wan"  # Wan 2.1 / 2.2 video (text-to-video; image-to-video checkpoints)
    qwen_image = "qwen_image"  # Qwen-Image: a Qwen2.5-VL language-model encoder, an MMDiT, a Wan-style 3D VAE
    flux2 = "flux2"  # FLUX.2 dev: a Mistral-3 language-model encoder, embedded guidance (one call per step)
    flux2_klein = "flux2_klein"  # FLUX.2 Klein: a Qwen3 encoder, true CFG (two calls per step)


class Component(str, Enum):
    __str__ = str.__str__

    text_encoder = "text_encoder"
    text_encoder_2 = "text_encoder_2"
    text_encoder_3 = "text_encoder_3"
    unet = "unet"
    transformer = "transformer"
    transformer_2 = "transformer_2"  # Wan 2.2's low-noise expert (model_index.json's boundary_ratio switches to it)
    image_encoder = "image_encoder"  # Wan 2.1 image-to-video's CLIP vision encoder; Qwen-Image-Edit's Qwen2.5-VL one
    vae_encoder = "vae_encoder"
    vae_decoder = "vae_decoder"
    controlnet = "controlnet"

    @property
    def is_denoiser(self) -> bool:
        return self in (Component.unet, Component.transformer, Component.transformer_2)

    @property
    def is_text_encoder(self) -> bool:
        return self.value.startswith("text_encoder")

    @property
    def is_vae(self) -> bool:
        return self in (Component.vae_encoder, Component.vae_decoder)


class CfgKind(str, Enum):
    """How a family's pipeline runs guidance, from which engines.yaml's default `cfg` (and so the denoiser's batch
    shapes) follows."""

    __str__ = str.__str__

    batched = "batched"  # classic CFG: the prompt's and the negative prompt's rows in one call (or in two)
    true_cfg = "true_cfg"  # two calls per step, each over the request's rows, as diffusers makes them: split only
    embedded = "embedded"  # guidance is an input of the denoiser: one call per step over the request's rows

    @property
    def default_cfg(self) -> tuple[str, ...]:
        """engines.yaml's `cfg` where the file leaves it out (CfgMode values: engines_file is a floor above)."""
        return {CfgKind.batched: ("batched",), CfgKind.true_cfg: ("split",), CfgKind.embedded: ("none",)}[self]

    @property
    def words(self) -> str:
        return {CfgKind.batched: "classifier-free guidance",
                CfgKind.true_cfg: "true CFG (the prompt's call, then the negative prompt's, each over the request's rows)",
                CfgKind.embedded: "embedded guidance (one call per step)"}[self]

    @property
    def serving_cfg(self) -> frozenset[str]:
        """The `cfg` modes whose engines the family's requests run (true CFG: never batched's twice-the-rows ones)."""
        if self is CfgKind.true_cfg:
            return frozenset(("split", "parallel", "none"))
        return frozenset(("batched", "split", "parallel", "none"))


class WideFloat:
    """A component's default precision where its activations exceed fp16's range (DiTs: FLUX's transformer reaches
    a relative error of 0.037 in fp16 on the tiny model, over parity's 0.02 gate, and overflows on real checkpoints):
    bf16 on a target that builds bf16 graphs (TensorRT, the way NVIDIA's demo builds DiTs), fp32 on the others
    (a CPU target's bf16 is an fp32 graph at best, and OpenVINO refuses bf16 on CPUs without AMX/AVX512-BF16, so a
    per-host choice would change the engine keys from one machine to the next)."""

    on_bf16_targets = Precision.bf16
    elsewhere = Precision.fp32

    def __repr__(self) -> str:
        return "WIDE_FLOAT"


WIDE_FLOAT = WideFloat()


@dataclass(frozen=True)
class FamilyInfo:
    components: tuple[Component, ...]
    """Every component the family has (controlnet only where the family supports one)."""
    default_components: tuple[Component, ...]
    """What a text-to-image release needs when engines.yaml does not list components."""
    latent_factor: int
    """Pixel sides must be multiples of this: the VAE's 8, times 2 where latents are patchified."""
    denoiser: Component
    temporal_factor: int = 0
    """Video families: the VAE's temporal factor (frames must be 4k+1 for Wan's 4); 0: images, no frame axis."""
    text_lengths: tuple[int, int, int] | None = None
    """(min, opt, max) prompt tokens where the text length is a profile dimension (Qwen-Image: its pipeline pads a
    batch to its longest prompt), engines.yaml's `text_length` overriding; None: prompts padded to one length."""
    cfg_kind: CfgKind = CfgKind.batched
    """How its pipeline runs guidance: engines.yaml's default `cfg` follows (`default_cfg`), and `plan` refuses a
    `cfg` whose engines its requests cannot run (`CfgKind.serving_cfg`)."""
    default_precision: Mapping[Component, Precision | WideFloat] = field(default_factory=dict)
    """Per component, the precision where engines.yaml names none (before the file-wide fallback: fp32 VAEs,
    fp16 for the rest); `WIDE_FLOAT`: bf16 where the target builds bf16 graphs, else fp32."""

    @property
    def default_cfg(self) -> tuple[str, ...]:
        """engines.yaml's `cfg` where the file leaves it out (FLUX.2 dev's embedded guidance: "none", one call per
        step; Klein's and Qwen-Image's true CFG: "split", two calls as diffusers makes them; else "batched")."""
        return self.cfg_kind.default_cfg

    @property
    def is_video(self) -> bool:
        return self.temporal_factor > 0

    @property
    def supports_controlnet(self) -> bool:
        return Component.controlnet in self.components


_T = Component
FAMILIES: dict[Family, FamilyInfo] = {
    Family.sd15: FamilyInfo(
        components=(_T.text_encoder, _T.unet, _T.vae_encoder, _T.vae_decoder, _T.controlnet),
        default_components=(_T.text_encoder, _T.unet, _T.vae_decoder),
        latent_factor=8,
        denoiser=_T.unet,
    ),
    Family.sdxl: FamilyInfo(
        components=(_T.text_encoder, _T.text_encoder_2, _T.unet, _T.vae_encoder, _T.vae_decoder, _T.controlnet),
        default_components=(_T.text_encoder, _T.text_encoder_2, _T.unet, _T.vae_decoder),
        latent_factor=8,
        denoiser=_T.unet,
    ),
    Family.sd3: FamilyInfo(
        components=(_T.text_encoder, _T.text_encoder_2, _T.text_encoder_3, _T.transformer, _T.vae_encoder, _T.vae_decoder),
        default_components=(_T.text_encoder, _T.text_encoder_2, _T.text_encoder_3, _T.transformer, _T.vae_decoder),
        latent_factor=16,
        denoiser=_T.transformer,
    ),
    Family.flux: FamilyInfo(
        components=(_T.text_encoder, _T.text_encoder_2, _T.transformer, _T.vae_encoder, _T.vae_decoder),
        default_components=(_T.text_encoder, _T.text_encoder_2, _T.transformer, _T.vae_decoder),
        latent_factor=16,
        denoiser=_T.transformer,
        # FLUX.1's guidance is an embedding of the transformer (FluxPipeline runs no CFG): one call per step
        cfg_kind=CfgKind.embedded,
        default_precision={_T.transformer: WIDE_FLOAT},  # fp16 fails parity (0.037 > 0.02 on the tiny model)
    ),
    Family.wan: FamilyInfo(
        # image_encoder (Wan 2.1 I2V's CLIP vision tower) and vae_encoder serve image-to-video (workflows.img2vid)
        components=(_T.text_encoder, _T.image_encoder, _T.transformer, _T.transformer_2, _T.vae_encoder,
                    _T.vae_decoder),
        default_components=(_T.text_encoder, _T.transformer, _T.vae_decoder),
        latent_factor=16,  # the 3D VAE's 8 × the transformer's 2×2 spatial patches
        denoiser=_T.transformer,
        temporal_factor=4,
    ),
    Family.qwen_image: FamilyInfo(
        # vae_encoder serves img2img / inpaint (QwenImageImg2ImgPipeline, QwenImageInpaintPipeline) and edit
        # (QwenImageEditPipeline), whose image_encoder is the text encoder's Qwen2.5-VL vision tower
        components=(_T.text_encoder, _T.image_encoder, _T.transformer, _T.vae_encoder, _T.vae_decoder),
        default_components=(_T.text_encoder, _T.transformer, _T.vae_decoder),
        latent_factor=16,  # the VAE's 8 × the transformer's 2×2 patches
        denoiser=_T.transformer,
        # up to max_sequence_length's default; 2 at least (torch.export specializes 0 and 1), tuned for 128
        text_lengths=(2, 128, 512),
        cfg_kind=CfgKind.true_cfg,  # QwenImagePipeline's true CFG: the prompt's call, then the negative prompt's
    ),
    Family.flux2: FamilyInfo(
        components=(_T.text_encoder, _T.transformer, _T.vae_decoder),
        default_components=(_T.text_encoder, _T.transformer, _T.vae_decoder),
        latent_factor=16,  # the VAE's 8 × the 2×2 patchified latents
        denoiser=_T.transformer,
        cfg_kind=CfgKind.embedded,  # guidance is an input of the transformer: one call per step
    ),
    Family.flux2_klein: FamilyInfo(
        components=(_T.text_encoder, _T.transformer, _T.vae_decoder),
        default_components=(_T.text_encoder, _T.transformer, _T.vae_decoder),
        latent_factor=16,
        denoiser=_T.transformer,
        cfg_kind=CfgKind.true_cfg,  # Flux2KleinPipeline's true CFG: the prompt's call, then the negative prompt's
    ),
}


def family_info(family: Family | str) -> FamilyInfo:
    return FAMILIES[Family(family)]


# model_index.json's `_class_name` of each family's text-to-image pipeline (and the variants diffusers saves),
# so engines.yaml's `family:` is checked against the folder it names.
PIPELINE_CLASSES: dict[Family, tuple[str, ...]] = {
    Family.sd15: ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline",
                  "StableDiffusionControlNetPipeline"),
    Family.sdxl: ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline",
                  "StableDiffusionXLControlNetPipeline"),
    Family.sd3: ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
    Family.flux: ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline",
                  "FluxKontextPipeline", "FluxControlPipeline"),
    Family.wan: ("WanPipeline", "WanImageToVideoPipeline"),
    Family.qwen_image: ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline",
                        "QwenImageEditPipeline"),
    Family.flux2: ("Flux2Pipeline",),
    Family.flux2_klein: ("Flux2KleinPipeline",),
}


def family_of_pipeline_class(class_name: str) -> Family | None:
    """The family whose pipeline a model_index.json names; None for a class no family claims."""
    for family, classes in PIPELINE_CLASSES.items():
        if class_name in classes:
            return family
    return None


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

# Flux2Pipeline and Flux2KleinPipeline pad every prompt (after the chat template) to max_sequence_length, 512 by
# default, and stack the encoder's hidden states at these layers (their text_encoder_out_layers defaults)
FLUX2_TEXT_LENGTH = 512
FLUX2_TEXT_LAYERS = {Family.flux2: (10, 20, 30), Family.flux2_klein: (9, 18, 27)}
# FLUX.2 dev and Klein: their text encoder engines stack a language model's hidden states at fixed layers
FLUX2_FAMILIES = tuple(FLUX2_TEXT_LAYERS)
# Families whose text encoder is a decoder-only language model (Qwen2.5-VL, Mistral-3, Qwen3): the one text encoder
# the quantize stage takes to fp8/int8 beside the denoiser (it is the size of the denoiser, or larger)
LM_ENCODER_FAMILIES = (Family.qwen_image, *FLUX2_FAMILIES)

WAN_TEXT_LENGTH = 512  # WanPipeline.__call__'s max_sequence_length default (Wan's own text_len): every prompt is padded to it

# The folder of a diffusers pipeline that holds each component (ControlNets have their own source).
SUBFOLDER = {
    Component.text_encoder: "text_encoder",
    Component.text_encoder_2: "text_encoder_2",
    Component.text_encoder_3: "text_encoder_3",
    Component.unet: "unet",
    Component.transformer: "transformer",
    Component.transformer_2: "transformer_2",
    Component.image_encoder: "image_encoder",
    Component.vae_encoder: "vae",
    Component.vae_decoder: "vae",
}


# The text encoders a LoRA may change, as diffusers' LoRA loaders load them (`_lora_loadable_modules`):
# the CLIP ones. T5 parts are not loaded by diffusers and are refused by name, never dropped.
LORA_TEXT_ENCODERS: dict[Family, tuple[Component, ...]] = {
    Family.sd15: (Component.text_encoder,),
    Family.sdxl: (Component.text_encoder, Component.text_encoder_2),
    Family.sd3: (Component.text_encoder, Component.text_encoder_2),
    Family.flux: (Component.text_encoder,),
    Family.wan: (),  # diffusers' WanLoraLoaderMixin loads the transformer(s) only
    Family.qwen_image: (),  # diffusers' QwenImageLoraLoaderMixin: _lora_loadable_modules = ["transformer"]
    Family.flux2: (),  # Flux2LoraLoaderMixin: the transformer only
    Family.flux2_klein: (),
}


def quantized_components(family: Family | str) -> tuple[Component, ...]:
    """What the quantize stage takes to fp8/int8 in `family`: the denoiser, Wan 2.2's second expert (the same
    architecture, calibrated on the low-noise steps it runs), and a language-model text encoder."""
    family = Family(family)
    info = family_info(family)
    chosen = [info.denoiser] + [c for c in (Component.transformer_2,) if c in info.components]
    return tuple(chosen + ([Component.text_encoder] if family in LM_ENCODER_FAMILIES else []))


def quantized_component(family: Family | str, component: Component | str) -> bool:
    return Component(component) in quantized_components(family)
