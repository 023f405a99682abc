"""From LoRA file keys to (component, module) layers with their alpha.

Key renaming is done by diffusers' own converters (kohya -> diffusers, old attn-processor forms ->
PEFT, Wan's original and musubi-tuner names -> diffusers: wan_naming.py), so this module only groups keys,
tracks where each layer came from (for error messages) and works out each layer's alpha. Alphas are kept
per module: kohya files carry one per module, diffusers files carry `lora_adapter_metadata` (lora_alpha,
alpha_pattern, use_rslora) or nothing (alpha = rank); diffusers' Wan converters bake them into the weights.

Wan 2.2's two experts: a file's `transformer.` (and unprefixed) keys are the `transformer`'s (the high-noise
expert), `transformer_2.` keys the low-noise expert's; `LoraFile.into_transformer_2` sends the transformer part
to `transformer_2` instead (diffusers' `load_into_transformer_2=True`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .files import LoraFile, LoraNaming
from .wan_naming import WAN_COMPONENT, convert_wan_lora, wan_form

# Component prefixes of diffusers-named files; keys with none of them belong to the model they are applied to.
COMPONENTS = ("unet", "transformer", "transformer_2", "controlnet", "text_encoder", "text_encoder_2",
              "text_encoder_3")
UNPREFIXED = ""
TRANSFORMER_2 = "transformer_2"
# what `into_transformer_2` moves: the part diffusers' Wan loader loads into `transformer`
_TRANSFORMER_PARTS = ("transformer", UNPREFIXED)
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


def _diffusers_named_layers(lora: LoraFile, tensors: dict[str, torch.Tensor] | None = None,
                            origins: dict[str, tuple[str, ...]] | None = None) -> dict[str, ComponentLayers]:
    """Layers of diffusers-named `tensors` (default: the file's); `origins` names the file keys each came from
    when the tensors are a conversion's (messages name the file's own keys)."""
    by_component: dict[str, dict[str, _Pair]] = {}
    results: dict[str, ComponentLayers] = {}
    origins = origins or {}
    for key, tensor in (lora.tensors if tensors is None else tensors).items():
        file_keys = origins.get(key, (key,))
        component, rest = _split_component(key)
        result = results.setdefault(component, ComponentLayers())
        pairs = by_component.setdefault(component, {})
        kind = _unsupported_kind(key)
        if kind is not None:
            result.problems.append((file_keys, f"{kind} weights are not supported"))
            continue
        if rest.endswith(".alpha"):
            pair = pairs.setdefault(_alpha_module(rest[: -len(".alpha")], component), _Pair())
            pair.alpha = float(tensor.item())
            pair.keys.extend(file_keys)
            continue
        match = _PEFT_KEY.match(_to_peft_key(rest, component))
        if match is None:
            result.problems.append((file_keys, "not a LoRA weight name this tool knows"))
            continue
        pair = pairs.setdefault(match["module"], _Pair())
        pair.keys.extend(k for k in file_keys if k not in pair.keys)
        slot = {("A", "weight"): "down", ("B", "weight"): "up", ("B", "bias"): "up_bias"}.get(
            (match["role"], match["kind"]))
        if slot is None:
            result.problems.append((file_keys, "a lora_A bias is not a LoRA form this tool knows"))
        elif getattr(pair, slot) is not None:
            reason = f"a second {slot} weight for {match['module']} (several adapters in one file?)"
            result.problems.append((file_keys, reason))
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


def _wan_named_layers(lora: LoraFile) -> dict[str, ComponentLayers]:
    """A Wan file in original or musubi-tuner (kohya) naming, through diffusers' own converter: the keys it drops
    or refuses are problems, named (never dropped)."""
    form = wan_form(list(lora.tensors))
    unsupported = {key: kind for key in lora.tensors if (kind := _unsupported_kind(key)) is not None}
    conversion = convert_wan_lora({k: v for k, v in lora.tensors.items() if k not in unsupported}, form)
    results = _diffusers_named_layers(lora, conversion.tensors, conversion.origins)
    problems = results.setdefault(WAN_COMPONENT, ComponentLayers()).problems
    problems.extend(((key,), f"{kind} weights are not supported") for key, kind in unsupported.items())
    problems.extend(conversion.problems)
    return results


def _into_transformer_2(lora: LoraFile, parts: dict) -> dict:
    """`into_transformer_2`: the transformer part (prefixed `transformer.` or not) becomes transformer_2's."""
    if not lora.into_transformer_2:
        return parts
    moved = {c: p for c, p in parts.items() if c in _TRANSFORMER_PARTS}
    parts = {c: p for c, p in parts.items() if c not in _TRANSFORMER_PARTS}
    if isinstance(next(iter(moved.values()), None), ComponentLayers):
        merged = parts.setdefault(TRANSFORMER_2, ComponentLayers())
        if merged.layers or merged.problems:
            keys = (tuple(k for layer in merged.layers.values() for k in layer.keys)
                    or tuple(k for held, _ in merged.problems for k in held))[:3]
            merged.problems.append((keys, "the file has a transformer_2 part of its own; loading its transformer part "
                                          "into transformer_2 too (into_transformer_2) would mix the two"))
        for part in moved.values():
            merged.layers.update(part.layers)
            merged.problems.extend(part.problems)
    elif moved:
        parts[TRANSFORMER_2] = parts.get(TRANSFORMER_2, 0) + sum(moved.values())
    return parts


def lora_layers(lora: LoraFile, unet_config: Any = None) -> dict[str, ComponentLayers]:
    """Every component's layers ("" holds keys with no component prefix). `unet_config` lets kohya
    SDXL (sgm) block names be mapped to diffusers names."""
    if wan_form(list(lora.tensors)) is not None:
        parts = _wan_named_layers(lora)
    elif lora.naming is LoraNaming.kohya:
        parts = _kohya_named_layers(lora, unet_config)
    else:
        parts = _diffusers_named_layers(lora)
    return _into_transformer_2(lora, parts)


def component_key_counts(lora: LoraFile) -> Counter:
    """How many of the file's keys belong to each component: what a report of unapplied parts needs."""
    counts: Counter = Counter()
    wan = wan_form(list(lora.tensors)) is not None
    for key in lora.tensors:
        if wan:  # diffusers' Wan converters give every key to the transformer
            counts[WAN_COMPONENT] += 1
        elif lora.naming is LoraNaming.kohya:
            found = _kohya_component(key.partition(".")[0])
            counts[found[1] if found else UNPREFIXED] += 1
        else:
            counts[_split_component(key)[0]] += 1
    return Counter(_into_transformer_2(lora, dict(counts)))
