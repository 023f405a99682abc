"""The LoRA set of one request: the `LORAS` input (a JSON string `[{"name": "style", "scale": 0.8}, ...]`), checked
and put in one canonical form.

The canonical form is what the batcher groups by, what the entry hands the engine models and what their LRU is
keyed by: sorted by name, scale-0 entries dropped (they change nothing, so `[{"name": "a", "scale": 0}]` is the
base model and shares its batches and its engine). Every mistake is one RuntimeInputError naming the field and the
value; a LoRA the repository does not serve is refused by name, listing the ones it does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import RuntimeInputError
from ..targets.lora_switch import MAX_LORA_SCALE, MAX_SET_LORAS, check_scale  # noqa: F401  (the one bound)

MAX_LORAS_BYTES = 4096  # the LORAS string, checked before it is parsed
MAX_LORAS_PER_REQUEST = MAX_SET_LORAS
KEYS = ("name", "scale")
_CLI_SCALE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_CLI_NON_FINITE = re.compile(r"[+-]?(?:nan|inf|infinity)", re.IGNORECASE)  # read, then refused as not finite
DEFAULT_SCALE = 1.0


@dataclass(frozen=True, order=True)
class LoraChoice:
    name: str
    scale: float


LoraSet = tuple[LoraChoice, ...]  # canonical: sorted by name, no scale 0
BASE: LoraSet = ()


def _scale(value: object, where: str) -> float:
    return check_scale(value, f"{where}.scale")


def _entry(item: object, index: int) -> LoraChoice:
    where = f"LORAS[{index}]"
    if not isinstance(item, dict):
        raise RuntimeInputError(f'{where} must be an object like {{"name": "style", "scale": 0.8}}, got '
                                f"{json.dumps(item)[:80]}")
    unknown = sorted(set(item) - set(KEYS))
    if unknown:
        raise RuntimeInputError(f"{where} has unknown key(s) {unknown} (allowed: {list(KEYS)})")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise RuntimeInputError(f"{where}.name must be a non-empty string, got {json.dumps(name)}")
    return LoraChoice(name, _scale(item.get("scale", DEFAULT_SCALE), where))


def canonical(choices: Sequence[LoraChoice]) -> LoraSet:
    """Sorted by name, scale-0 entries dropped; a name twice is refused."""
    seen: set[str] = set()
    for choice in choices:
        if choice.name in seen:
            raise RuntimeInputError(f"LORAS names {choice.name!r} twice (give each LoRA once, with its scale)")
        seen.add(choice.name)
    return tuple(sorted(c for c in choices if c.scale != 0.0))


def check_served(lora_set: LoraSet, served: Sequence[str]) -> None:
    unknown = [c.name for c in lora_set if c.name not in served]
    if unknown:
        offered = ", ".join(sorted(served)) if served else "none (package with `mode: refit` LoRAs in engines.yaml)"
        raise RuntimeInputError(f"LORAS: unknown LoRA {', '.join(map(repr, unknown))}; this model serves: {offered}")


def parse_loras(text: str | None, served: Sequence[str] | None = None) -> LoraSet:
    """The request's LORAS as a canonical set (absent or empty: the base model). `served`: the LoRA names the
    repository holds (None: not checked here)."""
    if text is None or not text.strip():
        return BASE
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_LORAS_BYTES:
        raise RuntimeInputError(f"LORAS has {size} bytes (at most {MAX_LORAS_BYTES})")
    try:
        items = json.loads(text)
    except ValueError as err:
        raise RuntimeInputError(f'LORAS is not valid JSON ({err.msg} at character {err.pos}); expected '
                                f'[{{"name": "style", "scale": 0.8}}, ...]') from None
    except RecursionError:  # 4096 bytes of "[" nest past the decoder's recursion limit
        raise RuntimeInputError('LORAS is nested too deeply; expected [{"name": "style", "scale": 0.8}, ...]') \
            from None
    if not isinstance(items, list):
        raise RuntimeInputError(f'LORAS must be a JSON list like [{{"name": "style", "scale": 0.8}}], got '
                                f"{json.dumps(items)[:80]}")
    if len(items) > MAX_LORAS_PER_REQUEST:
        raise RuntimeInputError(f"LORAS lists {len(items)} LoRAs (at most {MAX_LORAS_PER_REQUEST})")
    lora_set = canonical([_entry(item, index) for index, item in enumerate(items)])
    if served is not None:
        check_served(lora_set, served)
    return lora_set


def to_json(lora_set: Sequence[LoraChoice]) -> str:
    """The JSON a client sends and the entry passes on (compact, so equal sets give equal strings)."""
    return json.dumps([{"name": c.name, "scale": c.scale} for c in lora_set], separators=(",", ":"))


def parse_cli_lora(text: str) -> LoraChoice:
    """`generate --lora NAME[:SCALE]`."""
    name, _, scale = text.partition(":")
    if not name:
        raise RuntimeInputError(f"--lora {text!r}: expected NAME or NAME:SCALE (e.g. style:0.8)")
    if not scale:
        return LoraChoice(name, DEFAULT_SCALE)
    # a plain decimal only: float() also reads "1_0" as 10 and other scripts' digits, not what the user typed
    # ("nan"/"inf" pass on, to be refused as not finite)
    if not _CLI_SCALE.fullmatch(scale) and not _CLI_NON_FINITE.fullmatch(scale):  # one sign at most: float()
        # refuses "+-nan" with a ValueError, which would leave the command as a traceback
        raise RuntimeInputError(f"--lora {text!r}: the scale {scale!r} is not a number (write it like 0.8)")
    return LoraChoice(name, _scale(float(scale), f"--lora {name}"))
