"""A LoRA across a pipeline's components: the denoiser's part and the text encoders' parts, each fused against
its own base module, every LoRA with its own scale (as diffusers' `set_adapters` + `fuse_lora`).

A part no engine can take (a T5 text encoder's, a component the model does not build, a refit LoRA on
an engine that is not refittable) is named in one RefitError before anything is applied: never dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import RefitError
from .deltas import LoraWithScale, as_lora_file, lora_deltas
from .files import LoraFile
from .naming import UNPREFIXED, component_key_counts

ModuleLoader = Callable[[], torch.nn.Module]


def _parts(lora: LoraFile, denoiser: str) -> dict[str, int]:
    """Component -> how many of the file's keys belong to it (unprefixed keys are the denoiser's)."""
    parts: dict[str, int] = {}
    for component, count in component_key_counts(lora).items():
        name = denoiser if component == UNPREFIXED else component
        parts[name] = parts.get(name, 0) + count
    return parts


def pipeline_lora_weights(
    modules: Mapping[str, ModuleLoader | torch.nn.Module],
    loras: Sequence[LoraWithScale],
    *,
    denoiser: str,
    refusals: Mapping[str, str] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Component -> {parameter name: fused value} for every component whose engines take weights.

    `modules` maps each such component (`unet`, `text_encoder`, ...) to its base module or a function
    loading it (called only when a LoRA has a part for it). `denoiser` names the component unprefixed
    keys belong to. `refusals` gives, per component, why it cannot take weights (shown in the error).
    Components no LoRA touches get no entry; a component a LoRA touches at scale 0 gets `{}`.
    """
    refusals = dict(refusals or {})
    files = [(as_lora_file(source), scale) for source, scale in loras]
    problems = []
    for lora, _ in files:
        for component, count in sorted(_parts(lora, denoiser).items()):
            if component not in modules:
                why = refusals.get(component) or f"no engine of this model takes {component} weights"
                problems.append(f"{lora.path}: its {component} part ({count} keys): {why}")
    if problems:
        raise RefitError("cannot apply the LoRA(s) in full, so none of it is applied:\n  " + "\n  ".join(problems))
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for component, module in modules.items():
        wanted = [(lora, scale) for lora, scale in files if component in _parts(lora, denoiser)]
        if not wanted:
            continue
        base = module if isinstance(module, torch.nn.Module) else module()
        weights[component] = lora_deltas(base, wanted, component=component, report_unapplied=False)
    return weights
