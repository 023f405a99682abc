"""LoRA per request: a runner that switches an engine between LoRA sets by hot refit, keeping the last few.

A LoRA-serving engine model's version folder holds `loras/` (written by `package`, triton/lora_parts.py):

    loras/loras.json          schema_version, component, the base file and each LoRA's file with its sha256
    loras/base.safetensors    the base value of every parameter some served LoRA changes (torch names, fp32)
    loras/lora-<name>.safetensors  that LoRA's delta per parameter at scale 1 (its fused weights minus the base, fp32)

A set's weights are `base + sum(scale * delta)` over its LoRAs in name order (the canonical order, so the same set
gives the same bits whatever order a client listed it in), always from the base: A -> B -> A gives A's bits again.
The target's hook (`TargetBase.lora_runner`: onnxruntime and openvino here) makes a runner with those weights;
the base runner is kept apart and never evicted, so a base request after any set runs the base engine itself.
Up to `capacity` sets stay applied (least recently used dropped first): a repeat costs a dict lookup.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RuntimeInputError, ServeError
from ..workspace.files import sha256_file

FOLDER = "loras"
INDEX_FILE = "loras.json"
BASE_FILE = "base.safetensors"
SCHEMA_VERSION = 1
DEFAULT_CAPACITY = 4
# |scale| a set may give a LoRA: beyond this its delta swamps the weights, and inf/nan would poison them. The one
# bound: triton/lora_sets.py checks the LORAS input against it, and an engine model called directly checks here.
MAX_LORA_SCALE = 100.0
MAX_SET_LORAS = 8  # LoRAs in one set (LORAS: MAX_LORAS_PER_REQUEST)

SetKey = tuple[tuple[str, float], ...]  # ((name, scale), ...) sorted by name, no scale 0


@dataclass(frozen=True)
class LoraParts:
    """One engine's share of the served LoRAs, read from its `loras/` folder (sha256 checked)."""

    component: str
    base: dict[str, np.ndarray]
    deltas: dict[str, dict[str, np.ndarray]]  # LoRA name -> parameter -> delta at scale 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.deltas))

    @classmethod
    def read(cls, folder: Path) -> LoraParts | None:
        """The parts in `folder/loras/`, or None when the engine serves no LoRA."""
        from safetensors.numpy import load_file

        root = Path(folder) / FOLDER
        index_path = root / INDEX_FILE
        if not index_path.is_file():
            return None
        try:
            index = json.loads(index_path.read_text())
        except ValueError as err:
            raise ServeError(f"{index_path} is not valid JSON ({err}); package the repository again") from None
        if index.get("schema_version") != SCHEMA_VERSION:
            raise ServeError(f"{index_path} has schema_version {index.get('schema_version')!r}, this trt-diffusion "
                             f"reads {SCHEMA_VERSION}; package the repository again")

        def load(entry: dict, what: str) -> dict[str, np.ndarray]:
            path = root / entry["file"]
            if Path(entry["file"]).name != entry["file"] or not path.is_file():
                raise ServeError(f"{index_path}: {what} file {entry['file']!r} is missing; package again")
            if sha256_file(path) != entry["sha256"]:
                raise ServeError(f"{path} does not match the sha256 {index_path} records; package again")
            return load_file(str(path))

        base = load(index["base"], "base")
        deltas = {name: load(entry, f"LoRA {name!r}") for name, entry in index["loras"].items()}
        for name, delta in deltas.items():
            stray = sorted(set(delta) - set(base))
            if stray:
                raise ServeError(f"{index_path}: LoRA {name!r} changes {stray[:3]} that base.safetensors lacks")
        return cls(index["component"], base, deltas)

    def key(self, chosen: Iterable[tuple[str, float]]) -> SetKey:
        """What of a request's set this engine holds (the others have no part here), canonical."""
        return tuple(sorted((name, float(scale)) for name, scale in chosen if name in self.deltas and scale != 0.0))

    def weights(self, key: SetKey) -> dict[str, np.ndarray]:
        """Parameter -> fused value: base + sum(scale * delta) in name order, fp32 (the target's refit casts it to
        the engine's dtype, as it does the in-process refit's)."""
        fused: dict[str, np.ndarray] = {}
        for name, scale in key:
            for param, delta in self.deltas[name].items():
                if param not in fused:
                    fused[param] = self.base[param].astype(np.float32, copy=True)
                fused[param] += np.float32(scale) * delta
        return fused


RunnerFactory = Callable[[dict[str, np.ndarray]], Any]  # fused weights -> a runner over the engine with them


class LoraSwitchingRunner:
    """Wraps an engine's base runner: `select(set)` makes the next `run` use that LoRA set (seconds spent on it
    returned: 0 for the base, a lookup for a kept set, a refit otherwise). One instance is used by one thread at a
    time (a Triton python instance runs one execute at a time); a lock keeps a stray second caller correct."""

    def __init__(self, base: Any, parts: LoraParts, make_runner: RunnerFactory, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ServeError(f"the LoRA set cache must hold at least 1 set, got {capacity}")
        self.base, self.parts, self.make_runner, self.capacity = base, parts, make_runner, capacity
        self.name, self.inputs = base.name, base.inputs
        self.applied: OrderedDict[SetKey, Any] = OrderedDict()
        self.current: Any = base
        self.current_key: SetKey = ()
        self.switches = 0  # refits done (cache misses)
        self.last_change: str | None = None  # what the last select did: None (same set), base, cached or refit
        self._lock = threading.RLock()

    def select(self, chosen: Iterable[tuple[str, float]]) -> float:
        start = time.perf_counter()
        with self._lock:
            key = self.parts.key(chosen)
            self.last_change = None if key == self.current_key else "base" if not key else "cached"
            if not key:
                self.current, self.current_key = self.base, ()
                return 0.0
            runner = self.applied.get(key)
            if runner is None:
                self.last_change = "refit"
                while len(self.applied) >= self.capacity:  # free before building: never capacity + 1 sets at once
                    self.applied.popitem(last=False)
                    if self.current_key not in self.applied:
                        self.current, self.current_key = self.base, ()
                runner = self.make_runner(self.parts.weights(key))
                self.switches += 1
            self.applied[key] = runner
            self.applied.move_to_end(key)
            self.current, self.current_key = runner, key
        return time.perf_counter() - start

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            return self.current.run(feeds)


def check_scale(value: object, where: str) -> float:
    """A LoRA scale as a float: a number (not a bool), finite, |scale| <= MAX_LORA_SCALE. An int is compared
    before it is converted (float() of a 400-digit int raises OverflowError)."""
    bound = (f"{where} must be a finite number in [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}], got "
             f"{str(value)[:40]}{'...' if len(str(value)) > 40 else ''}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RuntimeInputError(f"{where} must be a number, got {json.dumps(value)[:80]}")
    if isinstance(value, int) and abs(value) > MAX_LORA_SCALE:
        raise RuntimeInputError(bound)
    scale = float(value)
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise RuntimeInputError(bound)
    return scale


def parse_set_parameter(text: Any) -> list[tuple[str, float]]:
    """The canonical set the entry sends in its request parameter ([{"name", "scale"}, ...] as JSON). An engine
    model can be called directly: every scale is checked as LORAS checks it (a NaN or 1e30 would give non-finite
    images, and each distinct scale a refit that evicts the cached sets)."""
    if text is None or text == "":
        return []
    try:
        items = json.loads(text) if isinstance(text, str) else text
    except (ValueError, RecursionError) as err:
        raise RuntimeInputError(f"the LoRA set parameter {str(text)[:80]!r} is malformed "
                                f"({type(err).__name__})") from None
    if not isinstance(items, list) or len(items) > MAX_SET_LORAS:
        raise RuntimeInputError(f"the LoRA set parameter {str(text)[:80]!r} must be a list of at most "
                                f"{MAX_SET_LORAS} {{\"name\", \"scale\"}} objects")
    chosen = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "scale" not in item:
            raise RuntimeInputError(f"the LoRA set parameter's entry {index} must be {{\"name\": str, \"scale\": "
                                    f"number}}, got {json.dumps(item)[:80]}")
        chosen.append((item["name"], check_scale(item["scale"], f"the LoRA set parameter's {item['name'][:40]!r} "
                                                                "scale")))
    return chosen
