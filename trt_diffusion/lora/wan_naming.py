"""Wan LoRAs not in diffusers naming, converted by diffusers' own Wan converters, every file key accounted for.

Two forms reach Wan users besides diffusers/PEFT naming (`transformer.blocks.0.attn1.to_q.lora_A.weight`):

| form | example key | diffusers' converter |
|---|---|---|
| the original Wan repository's module names (as ComfyUI and many community LoRAs store them) | `diffusion_model.blocks.0.self_attn.q.lora_A.weight` (or `lora_down`/`lora_up` + `.alpha`, `.diff_b`) | `_convert_non_diffusers_wan_lora_to_diffusers` |
| kohya naming (kohya-ss's musubi-tuner) | `lora_unet_blocks_0_self_attn_q.lora_down.weight` + `.alpha` | `_convert_musubi_wan_lora_to_diffusers` |

`WanLoraLoaderMixin.lora_state_dict` picks the converter by the same prefixes. The converters bake each module's
`alpha / rank` into the `lora_A`/`lora_B` tensors (as diffusers' `load_lora_weights` then applies them), and they
drop some keys without a word (a norm's `.diff`, leftover `.diff` weights, a `time_projection` bias without its
weight). This project never drops a key: the conversion is traced (every tensor carries the file keys it was
computed from), and a key that no converted weight came from is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

WAN_ORIGINAL_PREFIX = "diffusion_model."
WAN_KOHYA_PREFIX = "lora_unet_"
# a Wan attention block's own module names: what tells a Wan file from another family's in the same form
_WAN_ORIGINAL_BLOCK = re.compile(r"^diffusion_model\.blocks\.\d+\.(self_attn|cross_attn|ffn)\.")
_WAN_KOHYA_BLOCK = re.compile(r"^lora_unet_blocks_\d+_(self_attn|cross_attn|ffn)_")
WAN_COMPONENT = "transformer"  # diffusers' converters prefix every key with it


@dataclass(frozen=True)
class WanForm:
    name: str  # shown in messages
    converter: str  # the function of diffusers.loaders.lora_conversion_utils
    prefix: str


WAN_ORIGINAL = WanForm("original Wan naming", "_convert_non_diffusers_wan_lora_to_diffusers", WAN_ORIGINAL_PREFIX)
WAN_KOHYA = WanForm("kohya (musubi-tuner) Wan naming", "_convert_musubi_wan_lora_to_diffusers", WAN_KOHYA_PREFIX)


def wan_form(keys: list[str]) -> WanForm | None:
    """The non-diffusers Wan form of a file's keys: all of them carry its prefix and some a Wan block's names."""
    for form, block in ((WAN_ORIGINAL, _WAN_ORIGINAL_BLOCK), (WAN_KOHYA, _WAN_KOHYA_BLOCK)):
        if keys and all(k.startswith(form.prefix) for k in keys) and any(block.match(k) for k in keys):
            return form
    return None


class _Traced(torch.Tensor):
    """A tensor that remembers which file keys it was computed from; `log` (shared by one conversion) collects
    every key any operation read (an alpha read by `.item()` included)."""

    sources: frozenset[str]
    log: set[str]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        traced = [a for a in _flatten((args, kwargs or {})) if isinstance(a, _Traced)]
        sources = frozenset().union(*(getattr(t, "sources", frozenset()) for t in traced))
        log = next((t.log for t in traced if hasattr(t, "log")), None)
        if log is not None:
            log.update(sources)
        result = super().__torch_function__(func, types, args, kwargs)
        for out in _flatten(result):
            if isinstance(out, _Traced) and log is not None:
                out.sources, out.log = sources, log
        return result


def _flatten(value) -> list:
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _flatten(part)]
    if isinstance(value, Mapping):
        return [item for part in value.values() for item in _flatten(part)]
    return [value]


def _traced(key: str, tensor: torch.Tensor, log: set[str]) -> _Traced:
    # a copy: the converters scale some tensors in place (`converted[key] *= scale`)
    out = tensor.detach().clone().as_subclass(_Traced)
    out.sources, out.log = frozenset({key}), log
    return out


@dataclass
class WanConversion:
    """diffusers-named tensors (`transformer.blocks.0.attn1.to_q.lora_A.weight`, alphas baked in), the file keys
    each came from, and the file keys the conversion refused or dropped (with why)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    origins: dict[str, tuple[str, ...]] = field(default_factory=dict)
    problems: list[tuple[tuple[str, ...], str]] = field(default_factory=list)


def _converter(form: WanForm) -> Callable[[dict], dict]:
    from diffusers.loaders import lora_conversion_utils

    return getattr(lora_conversion_utils, form.converter)


def _failure(form: WanForm, exc: Exception) -> str:
    if isinstance(exc, KeyError):
        missing = exc.args[0] if exc.args else "?"
        return (f"diffusers' converter for {form.name} ({form.converter}) needs {form.prefix}{missing}, which the "
                "file lacks, so it converts none of the file")
    message = " ".join(str(exc).split())
    if len(message) > 300:
        message = message[:300] + "..."
    return (f"diffusers' converter for {form.name} ({form.converter}) refuses the file "
            f"({type(exc).__name__}: {message})")


def convert_wan_lora(tensors: Mapping[str, torch.Tensor], form: WanForm) -> WanConversion:
    """The file's tensors through diffusers' converter for `form`; every key accounted for."""
    log: set[str] = set()
    traced = {key: _traced(key, tensor, log) for key, tensor in tensors.items()}
    result = WanConversion()
    try:
        converted: dict[str, Any] = _converter(form)(dict(traced))
    except Exception as exc:  # noqa: BLE001 - diffusers' refusal of this file, reported with its keys
        # the keys diffusers' message names (the ones it has no place for), else every key: none is converted
        named = [key for key in tensors if f"'{key[len(form.prefix):]}'" in str(exc)] or list(tensors)
        result.problems = [((named[0],), _failure(form, exc))]
        result.problems += [((key,), "not converted either (see above)") for key in named[1:]]
        return result
    used = set(log)
    for key, value in converted.items():
        sources = getattr(value, "sources", frozenset())
        used |= sources
        result.tensors[key] = value.as_subclass(torch.Tensor) if isinstance(value, torch.Tensor) else value
        result.origins[key] = tuple(sorted(sources))
    _attach_alphas(result, [key for key in tensors if key.endswith(".alpha") and key in used])
    dropped = [key for key in tensors if key not in used]
    result.problems = [((key,), f"diffusers' converter for {form.name} ({form.converter}) drops it: no weight "
                                "is made from it, so diffusers would not apply it either") for key in dropped]
    return result


def _attach_alphas(result: WanConversion, alphas: list[str]) -> None:
    """An alpha the converter baked in is named with the weights of its module (in messages)."""
    for alpha in alphas:
        stem = alpha[: -len("alpha")]
        for key, origins in result.origins.items():
            if any(origin.startswith(stem) for origin in origins):
                result.origins[key] = tuple(sorted({*origins, alpha}))
