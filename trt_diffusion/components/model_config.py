"""The facts about a model folder that fix a component's tensor shapes.

A component's own config.json does not say everything: the latent size comes from the VAE, the text
length from a tokenizer (SD3's transformer sees CLIP's 77 tokens followed by T5's). This gathers them
from the diffusers folder without loading any weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelError
from ..families import Component, EditKind, Family, family_info
from ..models.loading import SUBFOLDER

# Tokenizers without a real limit write a huge model_max_length; use the length the pipelines use.
_UNBOUNDED = 1_000_000
_DEFAULT_LENGTH = {"CLIP": 77, "T5": 512}

# Which tokenizer feeds which text encoder.
_TOKENIZER_OF = {
    Component.text_encoder: "tokenizer",
    Component.text_encoder_2: "tokenizer_2",
    Component.text_encoder_3: "tokenizer_3",
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything shape-related about one component of one model folder (JSON-serialisable)."""

    component_config: Mapping[str, Any]  # the component's config.json (the VAE's for vae_encoder/decoder)
    vae_scale_factor: int  # pixels per latent pixel
    latent_channels: int
    sequence_length: int | None  # text tokens the component takes or attends to; None for VAEs
    image_tokens: int | None = None  # Wan 2.1 I2V's transformer: the image encoder's tokens it attends to

    def __getitem__(self, key: str) -> Any:
        return self.component_config[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.component_config.get(key, default)
        return default if value is None else value

    @property
    def language_config(self) -> Mapping[str, Any]:
        """A language-model text encoder's own config: a vision-language checkpoint's (transformers 5's Qwen2.5-VL,
        Mistral 3) nests it under `text_config`; a plain language model's is the component's config."""
        return self.get("text_config") or self.component_config

    def to_json(self) -> dict:
        data = {"component_config": dict(self.component_config), "vae_scale_factor": self.vae_scale_factor,
                "latent_channels": self.latent_channels, "sequence_length": self.sequence_length}
        if self.image_tokens is not None:  # absent elsewhere: every other export's hash is unchanged
            data["image_tokens"] = self.image_tokens
        return data


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ModelError(f"{path} is missing") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None


def vae_scale_factor(vae: Mapping[str, Any]) -> int:
    """Pixels per latent pixel of a VAE config: AutoencoderKL's one 2x per block after the first; Wan's 3D VAE
    states it (scale_factor_spatial); Qwen-Image's does not, and its pipeline takes 2 per temporal stage
    (`2 ** len(temperal_downsample)`, QwenImagePipeline.vae_scale_factor)."""
    if not vae.get("scale_factor_spatial") and vae.get("temperal_downsample") is not None:
        return 2 ** len(vae["temperal_downsample"])
    return int(vae.get("scale_factor_spatial") or 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1))


def vae_latent_channels(vae: Mapping[str, Any]) -> int:
    """Latent channels of a VAE config (AutoencoderKL's latent_channels, Wan's z_dim)."""
    return int(vae.get("latent_channels", vae.get("z_dim", 4)))


def tokenizer_length(model_dir: Path, tokenizer: str) -> int:
    config = read_json(Path(model_dir) / tokenizer / "tokenizer_config.json")
    length = int(config.get("model_max_length") or _UNBOUNDED)
    if length >= _UNBOUNDED:
        is_t5 = "T5" in str(config.get("tokenizer_class", ""))
        length = _DEFAULT_LENGTH["T5" if is_t5 else "CLIP"]
    return length


def component_config_path(model_dir: Path, component: Component, controlnet_dir: Path | None = None) -> Path:
    if component is Component.controlnet:
        if controlnet_dir is None:
            raise ModelError("a ControlNet export needs the ControlNet's folder")
        return Path(controlnet_dir) / "config.json"
    return Path(model_dir) / SUBFOLDER[component] / "config.json"


def load_model_config(model_dir: str | Path, family: Family | str, component: Component | str,
                      controlnet_dir: str | Path | None = None) -> ModelConfig:
    """Read the shape facts for `component` of the diffusers folder `model_dir`."""
    model_dir, family, component = Path(model_dir), Family(family), Component(component)
    vae = read_json(model_dir / "vae" / "config.json")
    if family_info(family).edit is EditKind.vision_reference and (component is Component.image_encoder or (
            component is Component.text_encoder and (model_dir / "processor").is_dir())):
        from .qwen_image_edit import vision_config

        # an edit checkpoint's Qwen2.5-VL: the vision tower's and the encoder's config, the processor's grid beside
        own = vision_config(model_dir)
    else:
        own = read_json(component_config_path(model_dir, component, Path(controlnet_dir) if controlnet_dir else None))
    return ModelConfig(
        component_config=own,
        vae_scale_factor=vae_scale_factor(vae),
        latent_channels=vae_latent_channels(vae),
        sequence_length=_sequence_length(model_dir, family, component),
        image_tokens=_image_tokens(model_dir, family, component, own),
    )


def _image_tokens(model_dir: Path, family: Family, component: Component, own: Mapping[str, Any]) -> int | None:
    # a video transformer attending to CLIP image tokens (Wan 2.1 image-to-video)
    if not family_info(family).is_video or not component.is_denoiser or own.get("image_dim") is None:
        return None
    path = model_dir / SUBFOLDER[Component.image_encoder] / "config.json"
    if not path.is_file():
        return None  # WanTransformer.io says what is missing
    from .video import clip_image_tokens

    return clip_image_tokens(read_json(path))


def _sequence_length(model_dir: Path, family: Family, component: Component) -> int | None:
    info = family_info(family)
    if component.is_text_encoder or component.is_denoiser:
        if info.padded_text_length is not None:
            return info.padded_text_length  # Wan's and FLUX.2's pipelines pad every prompt to max_sequence_length
        if info.text_lengths is not None:
            # the most prompt tokens (after Qwen-Image's template): its pipeline's max_sequence_length default. The
            # text length is a profile dimension up to it (components/qwen_image.py: text_lengths)
            return info.text_lengths[2]
    if component.is_text_encoder:
        return tokenizer_length(model_dir, _TOKENIZER_OF[component])
    if component in (Component.unet, Component.controlnet):
        return tokenizer_length(model_dir, "tokenizer")
    if component is Component.transformer:
        lengths = [tokenizer_length(model_dir, name) for name in info.denoiser_tokenizers]
        return None if not lengths or None in lengths else sum(lengths)
    return None
