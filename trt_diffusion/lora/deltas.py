"""The weights of a model with LoRAs fused: W + sum(scale * up @ down * alpha / rank), per changed parameter.

Always computed from the base weights handed in (never from a previous result), so applying A, then B,
then A again gives bit-identical weights for A. The model itself is never modified.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import RefitError
from .files import LoraFile, read_lora_file
from .naming import UNPREFIXED, ComponentLayers, LoraLayer, component_key_counts, lora_layers

logger = logging.getLogger(__name__)

LoraSource = str | Path | LoraFile
LoraWithScale = tuple[LoraSource, float]
MAX_LISTED = 10  # unmatched keys shown in one error
TEXT_MODEL_PREFIX = "text_model."


def base_parameter_name(name: str) -> str:
    """A parameter's name without PEFT's `base_layer` wrapper (TensorRT #4090's KeyError)."""
    return name.replace(".base_layer.", ".")


def base_parameters(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's own parameters by their plain names: PEFT adapter weights left out, wrappers unwrapped."""
    items = model.named_parameters() if isinstance(model, torch.nn.Module) else model.items()
    return {
        base_parameter_name(name): tensor
        for name, tensor in items
        if ".lora_" not in name and ".lora_magnitude_vector" not in name
    }


def infer_component(model: Any) -> str:
    """The key prefix a LoRA file uses for this model: `unet`, `transformer` or `controlnet`."""
    class_name = type(model).__name__
    if "ControlNet" in class_name:
        return "controlnet"
    if "Transformer" in class_name:
        return "transformer"
    return "unet"


def as_lora_file(source: LoraSource) -> LoraFile:
    return source if isinstance(source, LoraFile) else read_lora_file(source)


def _matrix(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], tensor.shape[1]) if tensor.ndim == 4 else tensor


def _shape_problem(layer: LoraLayer, weight: torch.Tensor) -> str | None:
    down, up = layer.down, layer.up
    if down.ndim not in (2, 4) or up.ndim not in (2, 4) or weight.ndim not in (2, 4):
        return f"unsupported ranks: down {tuple(down.shape)}, up {tuple(up.shape)}, weight {tuple(weight.shape)}"
    fits = up.shape[0] == weight.shape[0] and down.shape[1] == weight.shape[1] and up.shape[1] == down.shape[0]
    if weight.ndim == 4 and tuple(weight.shape[2:]) != (1, 1):
        # a k x k convolution: down carries the kernel, up is 1 x 1
        fits = fits and down.ndim == 4 and down.shape[2:] == weight.shape[2:] and tuple(up.shape[2:]) == (1, 1)
    elif down.ndim == 4 or up.ndim == 4:
        fits = fits and all(d == 1 for t in (down, up) if t.ndim == 4 for d in t.shape[2:])
    if fits:
        return None
    return (f"LoRA shapes down {tuple(down.shape)} / up {tuple(up.shape)} do not fit the model's weight "
            f"{tuple(weight.shape)}")


def layer_delta(layer: LoraLayer, weight: torch.Tensor) -> torch.Tensor:
    """up @ down in fp32, shaped like `weight` (unscaled). Convolutions as PEFT's Conv2d.get_delta_weight."""
    down, up = layer.down.float(), layer.up.float()
    if weight.ndim == 4 and tuple(weight.shape[2:]) != (1, 1):
        return torch.nn.functional.conv2d(down.transpose(0, 1), up).transpose(0, 1)
    return (_matrix(up) @ _matrix(down)).reshape(weight.shape)


def _unmatched_error(lora: LoraFile, component: str, unmatched: list[tuple[Sequence[str], str]]) -> RefitError:
    """One error naming the first unmatched keys (with why) and how many there are in all."""
    count = sum(len(keys) for keys, _ in unmatched)
    lines = [f"{', '.join(keys)}: {reason}" for keys, reason in unmatched[:MAX_LISTED]]
    rest = sum(len(keys) for keys, _ in unmatched[MAX_LISTED:])
    more = f"\n  ... and {rest} more key(s)" if rest else ""
    return RefitError(
        f"LoRA {lora.path} does not fit this {component}: {count} of {len(lora.tensors)} LoRA key(s) match no "
        f"weight (was it trained for another architecture or checkpoint?):\n  " + "\n  ".join(lines) + more
    )


def _report_unapplied(lora: LoraFile, component: str) -> None:
    others = {c: n for c, n in component_key_counts(lora).items() if c not in (component, UNPREFIXED)}
    if others:
        listed = ", ".join(f"{c}: {n} keys" for c, n in sorted(others.items()))
        logger.warning("LoRA %s: weights for other components are not applied (%s); this refit covers the %s only",
                       lora.path, listed, component)


def _component_layers(lora: LoraFile, component: str, config: Any) -> ComponentLayers:
    by_component = lora_layers(lora, unet_config=config)
    merged = ComponentLayers()
    for name in (component, UNPREFIXED):
        part = by_component.get(name)
        if part is not None:
            merged.layers.update(part.layers)
            merged.problems.extend(part.problems)
    if not merged.layers and not merged.problems:
        held = ", ".join(f"{c or '(no prefix)'}: {n} keys" for c, n in sorted(component_key_counts(lora).items()))
        raise RefitError(f"LoRA {lora.path} has no weights for the {component} (it holds {held})")
    return merged


def _matched_layers(
    lora: LoraFile, component: str, params: Mapping[str, torch.Tensor], config: Any
) -> list[tuple[LoraLayer, str, str | None]]:
    """(layer, weight name, bias name) for every layer, or a RefitError listing all that do not fit."""
    found = _component_layers(lora, component, config)
    unmatched: list[tuple[Sequence[str], str]] = [(keys, reason) for keys, reason in found.problems]
    matched = []
    for module, layer in found.layers.items():
        module = _module_in(params, module)
        weight_name, bias_name = f"{module}.weight", f"{module}.bias"
        weight = params.get(weight_name)
        if weight is None:
            unmatched.append((layer.keys, f"the {component} has no weight {weight_name}"))
            continue
        problem = _shape_problem(layer, weight)
        if problem is None and layer.up_bias is not None and bias_name not in params:
            problem = f"a bias delta, but {module} has no bias"
        if problem is not None:
            unmatched.append((layer.keys, problem))
            continue
        matched.append((layer, weight_name, bias_name if layer.up_bias is not None else None))
    if unmatched:
        raise _unmatched_error(lora, component, unmatched)
    return matched


def _module_in(params: Mapping[str, torch.Tensor], module: str) -> str:
    """The module's name in this model. CLIP text encoders lost their `text_model.` level in
    transformers 5, while LoRA files (kohya and diffusers alike) still spell it."""
    if f"{module}.weight" not in params and module.startswith(TEXT_MODEL_PREFIX):
        return module[len(TEXT_MODEL_PREFIX):]
    return module


def _check_scale(lora: LoraFile, scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise RefitError(f"LoRA {lora.path}: scale must be a finite number, got {scale!r}")
    return float(scale)


def lora_deltas(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    loras: Sequence[LoraWithScale] | Iterable[LoraWithScale],
    *,
    component: str | None = None,
    config: Any = None,
    report_unapplied: bool = True,
) -> dict[str, torch.Tensor]:
    """The fused values of every parameter the LoRAs change: `W + sum(scale * up @ down * alpha / rank)`.

    `model` is the base model (or its state dict); it is not modified. Keys are the model's parameter
    names (PEFT `base_layer` wrappers removed). A LoRA with scale 0 changes nothing. Every LoRA is
    checked in full first: keys that match no weight, or whose shapes do not fit, raise one RefitError.
    Weights for other components (text encoders) are reported in a warning and not applied.
    `component` is the LoRA key prefix to apply (default: `unet`/`transformer`/`controlnet` from the
    model's class); `config` (default `model.config`) maps kohya SDXL block names. `report_unapplied=False`
    when the caller applies (or refuses) the other components' parts itself (`components.py`).
    """
    params = base_parameters(model)
    component = component or infer_component(model)
    config = config if config is not None else getattr(model, "config", None)
    plan = []
    for source, scale in loras:
        lora = as_lora_file(source)
        scale = _check_scale(lora, scale)
        plan.append((scale, _matched_layers(lora, component, params, config)))
        if report_unapplied:
            _report_unapplied(lora, component)
    fused: dict[str, torch.Tensor] = {}
    for scale, matched in plan:
        if scale == 0.0:
            continue
        for layer, weight_name, bias_name in matched:
            base = params[weight_name]
            delta = layer_delta(layer, base) * (layer.scaling * scale)
            fused[weight_name] = fused.get(weight_name, base.detach().float()) + delta
            if bias_name is not None:
                bias_delta = layer.up_bias.float() * (layer.scaling * scale)
                fused[bias_name] = fused.get(bias_name, params[bias_name].detach().float()) + bias_delta
    return {name: value.to(params[name].dtype) for name, value in fused.items()}
