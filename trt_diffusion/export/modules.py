"""The torch module an export group is made from: the component, its ControlNet, LoRAs fused in."""

from __future__ import annotations

from pathlib import Path

import torch

from ..engines_file.load import ResolvedModel
from ..errors import ModelError
from ..families import Component
from ..models.loading import component_folder, load_component, load_controlnet
from .grouping import ExportGroup


def weights_folder(group: ExportGroup, model: ResolvedModel) -> Path:
    """The folder whose files (weights and config.json) the export depends on."""
    if group.component == Component.controlnet.value:
        return Path(model.controlnets[group.controlnet].path)
    folder, _ = component_folder(model.source.path, Component(group.component))
    return folder


def lora_files(group: ExportGroup, model: ResolvedModel) -> list[tuple[str, Path, float]]:
    """(name, file, scale) of each LoRA fused into this group's weights."""
    if group.lora_variant is None:
        return []
    return [(name, model.loras[name].path, scale) for name, _, scale in group.lora_variant.sources]


def load_group_module(group: ExportGroup, model: ResolvedModel) -> torch.nn.Module:
    """The fp32, eval-mode module, with the group's LoRAs fused into its weights."""
    component = Component(group.component)
    if component is Component.controlnet:
        module = load_controlnet(model.controlnets[group.controlnet].path)
    else:
        module = load_component(model.source.path, component)
    for name, path, scale in lora_files(group, model):
        fuse_lora(module, name, path, scale, prefix=component.value)
    return module.eval()


def fuse_lora(module: torch.nn.Module, name: str, path: Path, scale: float, prefix: str) -> None:
    """Merge a diffusers/PEFT-named LoRA into the module's weights; parameter names stay unchanged."""
    from ..lora.files import resolve_lora_path

    if not Path(path).is_file():
        raise ModelError(f"LoRA {name!r}: {path} not found")
    path = resolve_lora_path(path)  # .safetensors only, as refit: a pickled .bin can run code on load
    try:
        module.load_lora_adapter(str(path), prefix=prefix, adapter_name=name)
    except Exception as exc:  # safetensors / peft errors on a corrupt or foreign file
        raise ModelError(f"LoRA {name!r}: cannot load {path}: {str(exc).splitlines()[0]}") from exc
    if not any("lora_" in param for param, _ in module.named_parameters()):
        raise ModelError(f"LoRA {name!r} ({path}) matches no layer of the {prefix}: "
                         f"expected diffusers/PEFT keys starting with '{prefix}.'")
    module.fuse_lora(lora_scale=scale, adapter_names=[name])
    module.unload_lora()
