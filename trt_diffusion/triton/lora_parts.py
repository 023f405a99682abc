"""The LoRAs a repository serves per request: engines.yaml's `mode: refit` LoRAs, each split into the part every
refittable engine takes, written once at package time so the engine models never load a diffusers model.

Per component (the denoiser, and the CLIP text encoders a LoRA has a part for): `base.safetensors` (the base value
of every parameter some served LoRA changes) and `lora-<name>.safetensors` (that LoRA's delta at scale 1: its fused
weights minus the base), listed with their sha256 in `loras.json` (read back by targets/lora_switch.py). A set's
weights at serve time are `base + sum(scale * delta)`: equal to the in-process refit (`trt-diffusion refit`, which
fuses `W + scale * up @ down * alpha / rank`) to float32 rounding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..targets.lora_switch import BASE_FILE, INDEX_FILE, SCHEMA_VERSION
from ..workspace.files import sha256_file


@dataclass(frozen=True)
class ComponentParts:
    """One component's files, written once into a staging folder and linked into each of its engine models."""

    component: str
    folder: Path  # holds INDEX_FILE, BASE_FILE and one file per LoRA with a part here
    names: tuple[str, ...]


def served_lora_names(resolved_model: Any) -> tuple[str, ...]:
    """engines.yaml's refit LoRAs of a model (what a request may name in LORAS)."""
    from ..engines_file import LoraMode

    return tuple(sorted(name for name, lora in resolved_model.loras.items() if lora.mode is LoraMode.refit))


def write_parts(config: Any, model_name: str, built: Sequence[Any], out: Path) -> dict[str, ComponentParts]:
    """Compute and write every served LoRA's part per refittable component of `built` under `out/<component>/`.
    A LoRA part that no refittable engine takes is refused by name (pipeline_lora_weights' RefitError)."""
    import torch
    from safetensors.torch import save_file

    from ..engine_builds.stage import base_module
    from ..runtime.loader import refit_weights

    resolved = config.models[model_name]
    names = served_lora_names(resolved)
    refittable = sorted({e.spec.component for e in built if e.spec.refittable})
    if not names or not refittable:
        return {}
    deltas: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # component -> LoRA -> parameter -> delta
    touched: dict[str, set[str]] = {}
    for name in names:
        lora = resolved.loras[name]
        fused = refit_weights(config, model_name, [(lora.path, 1.0)], refittable=refittable)
        for component, weights in fused.items():
            base = dict(base_module(config, model_name, component).named_parameters())
            deltas.setdefault(component, {})[name] = {
                param: (value.float() - base[param].detach().float()).contiguous() for param, value in weights.items()}
            touched.setdefault(component, set()).update(weights)
    parts = {}
    for component, by_lora in deltas.items():
        folder = Path(out) / component
        folder.mkdir(parents=True, exist_ok=True)
        base = dict(base_module(config, model_name, component).named_parameters())
        files = {BASE_FILE: {p: base[p].detach().float().contiguous() for p in sorted(touched[component])}}
        files.update({_lora_file(name): tensors for name, tensors in by_lora.items()})
        for file_name, tensors in files.items():
            _atomic_save(save_file, tensors, folder / file_name)
        index = {"schema_version": SCHEMA_VERSION, "component": component,
                 "base": {"file": BASE_FILE, "sha256": sha256_file(folder / BASE_FILE)},
                 "loras": {name: {"file": _lora_file(name), "sha256": sha256_file(folder / _lora_file(name)),
                                  "source": str(resolved.loras[name].path), "parameters": len(by_lora[name])}
                           for name in sorted(by_lora)}}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        parts[component] = ComponentParts(component, folder, tuple(sorted(by_lora)))
    return parts


def _lora_file(name: str) -> str:
    """A LoRA's part file: engines.yaml names are plain file-name parts; the prefix keeps `base` apart from BASE_FILE."""
    return f"lora-{name}.safetensors"


def _atomic_save(save_file, tensors: Mapping[str, Any], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(dict(tensors), str(tmp))
    os.replace(tmp, path)


def unservable_reason(built: Sequence[Any], parts: Mapping[str, ComponentParts]) -> str | None:
    """Why these engines cannot switch LoRAs per request (an engine taking a part is not refittable, or its target
    has no `lora_runner`), or None. `package` then serves the base model only and says so in its notes."""
    from ..targets import get_target
    from ..targets.base import TargetBase

    problems = []
    for engine in built:
        if engine.spec.component not in parts:
            continue
        if engine.spec.piece:  # the step cache's pieces: their per-request switch is untested
            problems.append(f"{engine.spec.name} is a step-cache piece (per-request LoRA with a step cache is not "
                            "served yet; LoRAs there are applied at build)")
        elif not engine.spec.refittable:
            problems.append(f"{engine.spec.name} is not refittable")
        elif type(get_target(engine.spec.target)).lora_runner is TargetBase.lora_runner:
            problems.append(f"the {engine.spec.target} target cannot switch LoRAs per request ({engine.spec.name})")
        elif reason := get_target(engine.spec.target).lora_unservable_reason(engine.spec):
            problems.append(reason)
    if not problems:
        return None
    return ("LoRAs are not served per request (LORAS naming one is refused): " + "; ".join(dict.fromkeys(problems)))
