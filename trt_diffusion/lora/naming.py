"""From LoRA file keys to (component, module) layers with their alpha.

Key renaming is done by diffusers' own converters (kohya -> diffusers, old attn-processor forms ->
PEFT), so this module only groups keys, tracks where each layer came from (for error messages) and
works out each layer's alpha. Alphas are kept per module: kohya files carry one per module, diffusers
files carry `lora_adapter_metadata` (lora_alpha, alpha_pattern, use_rslora) or nothing (alpha = rank).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .files import LoraFile, LoraNaming

# Component prefixes of diffusers-named files; keys with none of them belong to the model they are applied to.
COMPONENTS = ("unet", "transformer", "controlnet", "text_encoder", "text_encoder_2", "text_encoder_3")
UNPREFIXED = ""
KOHYA_COMPONENTS = {
    "lora_unet_": "unet",
    "lora_transformer_": "transformer",
    "lora_te_": "text_encoder",
    "lora_te1_": "text_encoder",
    "lora_te2_": "text_encoder_2",
    "lora_te3_": "text_encoder_3",
}
_PEFT_KEY = re.compile(
    r"^(?P<module>.+)\.lora_(?P<role>A|B)(?:\.(?P<adapter>[A-Za-z0-9_\-]+))?\.(?P<kind>weight|bias)$"
)
_UNSUPPORTED_MARKERS = {
    "lora_magnitude_vector": "DoRA",
    "dora_scale": "DoRA",
    "hada_": "LoHa (LyCORIS)",
    "lokr_": "LoKr (LyCORIS)",
    "lora_mid": "LoCon with a mid weight (LyCORIS)",
}


@dataclass(frozen=True)
class LoraLayer:
    """One low-rank pair: delta W = up @ down * scaling (convolutions composed the same way)."""

    module: str
    down: torch.Tensor  # lora_A / lora_down: (rank, in[, kh, kw])
    up: torch.Tensor  # lora_B / lora_up: (out, rank[, 1, 1])
    alpha: float | None = None  # None: the diffusers/PEFT convention alpha = rank (scaling 1)
    up_bias: torch.Tensor | None = None  # PEFT lora_bias=True: a bias delta
    use_rslora: bool = False
    keys: tuple[str, ...] = ()  # the file's own keys, for error messages

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scaling(self) -> float:
        if self.alpha is None:
            return 1.0
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class ComponentLayers:
    """The layers of one component, and the keys that could not be read as LoRA layers."""

    layers: dict[str, LoraLayer] = field(default_factory=dict)
    problems: list[tuple[tuple[str, ...], str]] = field(default_factory=list)  # (file keys, why unreadable)


def _diffusers_converters() -> Any:
    from diffusers.loaders import lora_conversion_utils
    from diffusers.utils import state_dict_utils

    return lora_conversion_utils, state_dict_utils


def _unsupported_kind(key: str) -> str | None:
    return next((kind for marker, kind in _UNSUPPORTED_MARKERS.items() if marker in key), None)


def _split_component(key: str) -> tuple[str, str]:
    head, _, rest = key.partition(".")
    if head in COMPONENTS and rest:
        return head, rest
    return UNPREFIXED, key


def _to_peft_key(key: str, component: str) -> str:
    """One key in PEFT naming (`<module>.lora_A.weight`), through diffusers' own mapping tables."""
    _, sdu = _diffusers_converters()
    if component.startswith("text_encoder"):
        # text encoders: to_q_lora -> q_proj (CLIP names); the UNet table maps to_q_lora -> to_q
        tables = [sdu.DIFFUSERS_OLD_TO_PEFT, sdu.DIFFUSERS_TO_PEFT, sdu.UNET_TO_DIFFUSERS]
    else:
        tables = [sdu.UNET_TO_DIFFUSERS, sdu.DIFFUSERS_TO_PEFT]
    for table in tables:
        if _PEFT_KEY.match(key):
            break
        key = next(iter(sdu.convert_state_dict({key: None}, table)))
    return key.replace(".base_layer.", ".")  # PEFT-wrapped names (TensorRT #4090)


def _alpha_module(stem: str, component: str) -> str:
    """The module of a `<module>.alpha` key, spelled as its weights' keys are after conversion."""
    match = _PEFT_KEY.match(_to_peft_key(stem + ".lora.down.weight", component))
    return match["module"] if match else stem


@dataclass
class _Pair:
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    alpha: float | None = None
    keys: list[str] = field(default_factory=list)


def _metadata_for(lora: LoraFile, component: str) -> dict:
    meta = lora.adapter_metadata
    scoped = {k[len(component) + 1:]: v for k, v in meta.items() if component and k.startswith(component + ".")}
    if scoped:
        return scoped
    return {k: v for k, v in meta.items() if "." not in k}


def _metadata_alpha(meta: dict, module: str) -> float | None:
    from peft.utils.other import get_pattern_key

    patterns = meta.get("alpha_pattern") or {}
    if patterns:
        key = get_pattern_key(list(patterns), module)
        if key in patterns:
            return float(patterns[key])
    alpha = meta.get("lora_alpha")
    return None if alpha is None else float(alpha)


def _pairs_to_layers(
    pairs: dict[str, _Pair], meta: dict, result: ComponentLayers
) -> None:
    for module, pair in pairs.items():
        if pair.down is None or pair.up is None:
            missing = "lora_A/lora_down" if pair.down is None else "lora_B/lora_up"
            result.problems.append((tuple(pair.keys), f"no matching {missing} weight"))
            continue
        alpha = pair.alpha if pair.alpha is not None else _metadata_alpha(meta, module)
        result.layers[module] = LoraLayer(
            module=module, down=pair.down, up=pair.up, alpha=alpha, up_bias=pair.up_bias,
            use_rslora=bool(meta.get("use_rslora", False)), keys=tuple(pair.keys),
        )


def _diffusers_named_layers(lora: LoraFile) -> dict[str, ComponentLayers]:
    by_component: dict[str, dict[str, _Pair]] = {}
    results: dict[str, ComponentLayers] = {}
    for key, tensor in lora.tensors.items():
        component, rest = _split_component(key)
        result = results.setdefault(component, ComponentLayers())
        pairs = by_component.setdefault(component, {})
        kind = _unsupported_kind(key)
        if kind is not None:
            result.problems.append(((key,), f"{kind} weights are not supported"))
            continue
        if rest.endswith(".alpha"):
            pair = pairs.setdefault(_alpha_module(rest[: -len(".alpha")], component), _Pair())
            pair.alpha = float(tensor.item())
            pair.keys.append(key)
            continue
        match = _PEFT_KEY.match(_to_peft_key(rest, component))
        if match is None:
            result.problems.append(((key,), "not a LoRA weight name this tool knows"))
            continue
        pair = pairs.setdefault(match["module"], _Pair())
        pair.keys.append(key)
        slot = {("A", "weight"): "down", ("B", "weight"): "up", ("B", "bias"): "up_bias"}.get(
            (match["role"], match["kind"]))
        if slot is None:
            result.problems.append(((key,), "a lora_A bias is not a LoRA form this tool knows"))
        elif getattr(pair, slot) is not None:
            reason = f"a second {slot} weight for {match['module']} (several adapters in one file?)"
            result.problems.append(((key,), reason))
        else:
            setattr(pair, slot, tensor)
    for component, pairs in by_component.items():
        _pairs_to_layers(pairs, _metadata_for(lora, component), results[component])
    return results


def _kohya_component(lora_name: str) -> tuple[str, str] | None:
    # longest prefix first: lora_te1_ before lora_te_
    for prefix in sorted(KOHYA_COMPONENTS, key=len, reverse=True):
        if lora_name.startswith(prefix):
            return prefix, KOHYA_COMPONENTS[prefix]
    return None


def _sgm_renames(keys: list[str], unet_config: Any) -> dict[str, str]:
    """kohya SDXL files use the original (sgm) block names; diffusers maps them given the UNet config."""
    lcu, _ = _diffusers_converters()
    if unet_config is None or not hasattr(unet_config, "layers_per_block"):
        return {key: key for key in keys}
    try:
        renamed = lcu._maybe_map_sgm_blocks_to_diffusers({key: key for key in keys}, unet_config)
    except ValueError:
        return {key: key for key in keys}
    return {original: new for new, original in renamed.items()}


def _kohya_named_layers(lora: LoraFile, unet_config: Any) -> dict[str, ComponentLayers]:
    lcu, _ = _diffusers_converters()
    results: dict[str, ComponentLayers] = {}
    pairs_by_component: dict[str, dict[str, _Pair]] = {}
    renames = _sgm_renames([k for k in lora.tensors if k.startswith("lora_unet_")], unet_config)
    for key, tensor in lora.tensors.items():
        lora_name, _, suffix = key.partition(".")
        prefix_component = _kohya_component(lora_name)
        component = prefix_component[1] if prefix_component else UNPREFIXED
        result = results.setdefault(component, ComponentLayers())
        kind = _unsupported_kind(key)
        if kind is not None or prefix_component is None:
            result.problems.append(((key,), f"{kind or 'unknown kohya'} weights are not supported"))
            continue
        if suffix not in ("lora_down.weight", "lora_up.weight", "alpha"):
            result.problems.append(((key,), "not a LoRA weight name this tool knows"))
            continue
        down_key = renames.get(key, key).partition(".")[0] + ".lora_down.weight"
        if component in ("unet", "transformer"):
            diffusers_key = lcu._convert_unet_lora_key(down_key.replace("lora_transformer_", "lora_unet_"))
        else:
            diffusers_key = lcu._convert_text_encoder_lora_key(down_key, down_key.partition(".")[0])
        peft_key = _to_peft_key(diffusers_key, component)
        match = _PEFT_KEY.match(peft_key)
        if match is None:
            reason = f"diffusers' kohya converter gives {diffusers_key!r}, not a LoRA weight name"
            result.problems.append(((key,), reason))
            continue
        pair = pairs_by_component.setdefault(component, {}).setdefault(match["module"], _Pair())
        pair.keys.append(key)
        if suffix == "alpha":
            pair.alpha = float(tensor.item())
        elif suffix == "lora_down.weight":
            pair.down = tensor
        else:
            pair.up = tensor
    for component, pairs in pairs_by_component.items():
        _pairs_to_layers(pairs, {}, results[component])
    return results


def lora_layers(lora: LoraFile, unet_config: Any = None) -> dict[str, ComponentLayers]:
    """Every component's layers ("" holds keys with no component prefix). `unet_config` lets kohya
    SDXL (sgm) block names be mapped to diffusers names."""
    if lora.naming is LoraNaming.kohya:
        return _kohya_named_layers(lora, unet_config)
    return _diffusers_named_layers(lora)


def component_key_counts(lora: LoraFile) -> Counter:
    """How many of the file's keys belong to each component: what a report of unapplied parts needs."""
    counts: Counter = Counter()
    for key in lora.tensors:
        if lora.naming is LoraNaming.kohya:
            found = _kohya_component(key.partition(".")[0])
            counts[found[1] if found else UNPREFIXED] += 1
        else:
            counts[_split_component(key)[0]] += 1
    return counts
