"""What each model family is: one declaration per family (families/<name>.py, a `FamilyInfo`), registered here.

Pure data, no torch: the spec layer validates engines.yaml against it, and every stage asks the declaration
(`family_info(family).<field>`) instead of naming a family. Adding a family: its `Family` member (base.py), its
module here with a `DECLARATION`, and its line in `_DECLARATIONS` (docs/ARCHITECTURE.md, "Adding a family").
"""

from __future__ import annotations

from . import flux, flux2, flux2_klein, qwen_image, sd3, sd15, sdxl, wan, z_image
from .base import (
    SUBFOLDER,
    WIDE_FLOAT,
    CfgKind,
    Component,
    EditKind,
    Family,
    FamilyInfo,
    LatentRgb,
    RequestInput,
    TextEncoding,
    WideFloat,
)
from .flux2 import FLUX2_TEXT_LENGTH
from .qwen_image import (
    QWEN_EDIT_TEMPLATE,
    QWEN_EDIT_TEMPLATE_PREFIX,
    QWEN_EDIT_TEMPLATE_TOKENS,
    QWEN_MAX_TEXT_LENGTH,
    QWEN_TEMPLATE_TOKENS,
    QWEN_TEXT_LENGTH,
)
from .wan import WAN_TEXT_LENGTH

# The registry: one line per family.
_DECLARATIONS = {
    Family.sd15: sd15.DECLARATION,
    Family.sdxl: sdxl.DECLARATION,
    Family.sd3: sd3.DECLARATION,
    Family.flux: flux.DECLARATION,
    Family.wan: wan.DECLARATION,
    Family.qwen_image: qwen_image.DECLARATION,
    Family.flux2: flux2.DECLARATION,
    Family.flux2_klein: flux2_klein.DECLARATION,
    Family.z_image: z_image.DECLARATION,
}
FAMILIES: dict[Family, FamilyInfo] = {family: _DECLARATIONS[family] for family in Family}  # every member declared


def family_info(family: Family | str) -> FamilyInfo:
    return FAMILIES[Family(family)]


# Views derived from the declarations, for the importers that read them as tables.
PIPELINE_CLASSES: dict[Family, tuple[str, ...]] = {f: info.pipeline_classes for f, info in FAMILIES.items()}
LORA_TEXT_ENCODERS: dict[Family, tuple[Component, ...]] = {f: info.lora_text_encoders for f, info in FAMILIES.items()}
FLUX2_TEXT_LAYERS = {f: info.text_layers for f, info in FAMILIES.items() if info.text_layers is not None}


def request_inputs_of_all() -> dict[str, RequestInput]:
    """Every request input some family adds, by its diffusers argument: what the client and the Triton parser read
    (one argument declared by two families must have one type; which family's entry takes it is the entry's
    config, and the runtime checks it against the family's own declaration)."""
    table: dict[str, RequestInput] = {}
    for info in FAMILIES.values():
        for declared in info.request_inputs:
            known = table.setdefault(declared.argument, declared)
            if known.data_type is not declared.data_type:
                raise ValueError(f"request input {declared.name} is declared as {known.data_type.__name__} and "
                                 f"{declared.data_type.__name__}")
    return table


def declared_code(locator: str):
    """The code a declaration names lazily ("module:name": its `loop`, `tiny_builder`, `trace_patches`, ...),
    imported on first use, as target_registry imports a target."""
    import importlib

    module, _, name = locator.partition(":")
    return getattr(importlib.import_module(module), name)


def family_of_pipeline_class(class_name: str) -> Family | None:
    """The family whose pipeline a model_index.json names; None for a class no family claims."""
    for family, info in FAMILIES.items():
        if class_name in info.pipeline_classes:
            return family
    return None


def quantized_components(family: Family | str) -> tuple[Component, ...]:
    """What the quantize stage takes to fp8/int8 in `family`: the denoiser, Wan 2.2's second expert (the same
    architecture, calibrated on the low-noise steps it runs), and a language-model text encoder."""
    info = family_info(family)
    chosen = [info.denoiser] + [c for c in (Component.transformer_2,) if c in info.components]
    return tuple(chosen + ([Component.text_encoder] if info.language_model_encoder else []))


def quantized_component(family: Family | str, component: Component | str) -> bool:
    return Component(component) in quantized_components(family)


__all__ = [
    "FAMILIES", "FLUX2_TEXT_LAYERS", "FLUX2_TEXT_LENGTH", "LORA_TEXT_ENCODERS", "PIPELINE_CLASSES", "QWEN_EDIT_TEMPLATE", "QWEN_EDIT_TEMPLATE_PREFIX",
    "QWEN_EDIT_TEMPLATE_TOKENS", "QWEN_MAX_TEXT_LENGTH", "QWEN_TEMPLATE_TOKENS", "QWEN_TEXT_LENGTH", "SUBFOLDER",
    "WAN_TEXT_LENGTH", "WIDE_FLOAT", "CfgKind", "Component", "EditKind", "Family", "FamilyInfo", "LatentRgb",
    "RequestInput", "TextEncoding", "WideFloat", "declared_code", "family_info", "family_of_pipeline_class", "quantized_component", "quantized_components",
    "request_inputs_of_all",
]
