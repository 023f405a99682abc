"""Which declaration describes each (family, component)."""

from __future__ import annotations

from ..errors import ConfigError
from ..families import Component, Family, family_info
from .base import ComponentDef
from .controlnet import ControlNet
from .deepcache import DeepCachePiece
from .first_block import FirstBlockPiece
from .flux2 import Flux2TextEncoder, Flux2Transformer, Flux2VaeDecoder
from .qwen_image import QwenImageTransformer, QwenTextEncoder, QwenVaeDecoder, QwenVaeEncoder
from .qwen_image_edit import QwenVisionEncoder
from .text_encoders import ClipTextEncoder, T5TextEncoder
from .transformers import FluxTransformer, SD3Transformer
from .unet import UNet
from .vae import VaeDecoder, VaeEncoder
from .video import ClipImageEncoder, UMT5TextEncoder, WanTransformer, WanVaeDecoder, WanVaeEncoder
from .z_image import ZImageTextEncoder, ZImageTransformer

_F, _C = Family, Component


def _build() -> dict[tuple[Family, Component], ComponentDef]:
    defs: list[ComponentDef] = [
        # sd15 and flux feed the last CLIP layer; sdxl and sd3 the penultimate one (as their pipelines do)
        ClipTextEncoder(_F.sd15, _C.text_encoder, penultimate=False, with_projection=False),
        UNet(_F.sd15, _C.unet),
        ControlNet(_F.sd15, _C.controlnet),
        ClipTextEncoder(_F.sdxl, _C.text_encoder, penultimate=True, with_projection=False),
        ClipTextEncoder(_F.sdxl, _C.text_encoder_2, penultimate=True, with_projection=True),
        UNet(_F.sdxl, _C.unet),
        ControlNet(_F.sdxl, _C.controlnet),
        ClipTextEncoder(_F.sd3, _C.text_encoder, penultimate=True, with_projection=True),
        ClipTextEncoder(_F.sd3, _C.text_encoder_2, penultimate=True, with_projection=True),
        T5TextEncoder(_F.sd3, _C.text_encoder_3),
        SD3Transformer(_F.sd3, _C.transformer),
        ClipTextEncoder(_F.flux, _C.text_encoder, penultimate=False, with_projection=False),
        T5TextEncoder(_F.flux, _C.text_encoder_2),
        FluxTransformer(_F.flux, _C.transformer),
        UMT5TextEncoder(_F.wan, _C.text_encoder),
        WanTransformer(_F.wan, _C.transformer),
        WanTransformer(_F.wan, _C.transformer_2),
        WanVaeDecoder(_F.wan, _C.vae_decoder),
        WanVaeEncoder(_F.wan, _C.vae_encoder),
        ClipImageEncoder(_F.wan, _C.image_encoder),
        QwenTextEncoder(_F.qwen_image, _C.text_encoder),
        QwenVisionEncoder(_F.qwen_image, _C.image_encoder),  # Qwen-Image-Edit: the text encoder's vision tower
        QwenImageTransformer(_F.qwen_image, _C.transformer),
        QwenVaeDecoder(_F.qwen_image, _C.vae_decoder),  # the Wan-style 3D VAE on one frame
        QwenVaeEncoder(_F.qwen_image, _C.vae_encoder),
        Flux2TextEncoder(_F.flux2, _C.text_encoder),
        Flux2Transformer(_F.flux2, _C.transformer),
        Flux2TextEncoder(_F.flux2_klein, _C.text_encoder),
        Flux2Transformer(_F.flux2_klein, _C.transformer),
        Flux2VaeDecoder(_F.flux2, _C.vae_decoder),  # the pipelines' batch-norm denormalization in its graph
        Flux2VaeDecoder(_F.flux2_klein, _C.vae_decoder),
        ZImageTextEncoder(_F.z_image, _C.text_encoder),  # its VAE is the generic AutoencoderKL declaration
        ZImageTransformer(_F.z_image, _C.transformer),
    ]
    own_vae = {d.family for d in defs if d.component.is_vae}  # video families and Qwen-Image declare theirs (above)
    for family in Family:
        if family not in own_vae:
            halves = (VaeEncoder(family, _C.vae_encoder), VaeDecoder(family, _C.vae_decoder))
            defs += [d for d in halves if d.component in family_info(family).components]
    return {(d.family, d.component): d for d in defs}


_REGISTRY = _build()

# A step cache's pieces of a denoiser (step_cache.PIECES), by (family, component, piece).
_PIECES: dict[tuple[Family, Component, str], ComponentDef] = {
    (family, _C.unet, piece): DeepCachePiece(family, _C.unet, piece)
    for family in (_F.sd15, _F.sdxl) for piece in ("unet_deep", "unet_shallow")
} | {(_F.flux, _C.transformer, piece): FirstBlockPiece(_F.flux, _C.transformer, piece)
     for piece in ("first_block", "rest_blocks")}


def get_component(family: Family | str, component: Component | str, piece: str | None = None) -> ComponentDef:
    """The declaration of `component` in `family` (of its step-cache `piece` where given); ConfigError when the
    family has no such component."""
    try:
        family, component = Family(family), Component(component)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if piece is not None:
        found = _PIECES.get((family, component, piece))
        if found is None:
            raise ConfigError(f"no {piece} graph of the {family.value} {component.value} in this trt-diffusion "
                              f"(step-cache pieces: {', '.join(sorted({p for _, _, p in _PIECES}))})")
        return found
    definition = _REGISTRY.get((family, component))
    if definition is None:
        available = ", ".join(c.value for c in family_info(family).components)
        raise ConfigError(f"the {family.value} family has no {component.value} (it has: {available})")
    return definition


def registered_components() -> list[tuple[Family, Component]]:
    return list(_REGISTRY)
