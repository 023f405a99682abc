"""LoRA per request on TensorRT: what `TensorRTTarget.lora_runner` hands `LoraSwitchingRunner` (targets/lora_switch.py).

The other targets build a runner per LoRA set (a new ONNX Runtime session, a recompiled OpenVINO model). A TensorRT
engine is refitted in place instead: one engine per instance, its weight sets kept resident on the GPU, a swap queued
as `refit_cuda_engine_async` on the serving runner's stream before the run it is for (`TensorRTRunner.serve_loras`,
`refit(..., resident=True)`). So a set's runner here is a view of the instance's base runner: its `run` asks the base
runner to hold that set for the run; the base runner's own `run` holds the base weights. The request contract, the
set cache (`--lora-cache-sets`: the same count of sets stays resident on the GPU), the metrics and the refusals are
LoraSwitchingRunner's and `package`'s, as for onnxruntime and openvino.

Refused (at `package`, `lora_unservable_reason`; again here): fp8/int8 engines (a LoRA needs its weight scales
recomputed and the base refit reads host memory) and engines built without REFIT (a stripped plan without REFIT is
REFIT_IDENTICAL: only its own weights may go back in).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ServeError
from .manifest import PACKAGED_PLAN, EngineManifest, manifest_path

CACHE_SETS_PARAMETER = "lora_cache_sets"


def lora_unservable_reason(flags: Mapping[str, Any], name: str) -> str | None:
    """Why an engine built with `flags` cannot switch LoRAs per request on TensorRT, or None."""
    from ...precision import is_quantized

    if is_quantized(str(flags.get("precision", ""))):
        return (f"{name} is an {flags.get('precision')} TensorRT engine: a LoRA there needs its weight scales "
                "recomputed (`trt-diffusion refit`, or `mode: fused`), which a per-request swap does not do")
    if not flags.get("refit"):
        return f"{name} was not built with REFIT (a TensorRT engine refits per request only then)"
    return None


class TensorRTLoraRunner:
    """One LoRA set of an instance's serving TensorRTRunner: `run` holds this set in the engine for the run."""

    def __init__(self, base: Any, weights: Mapping[str, np.ndarray]):
        from .refit_weights import weights_digest

        self.base, self.weights = base, dict(weights)
        self.digest = weights_digest(self.weights)  # once: the base runner compares digests, never the arrays
        self.name, self.inputs = base.name, base.inputs

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return self.base.run_with_set(feeds, self.digest, self.weights)


def cache_sets(model_folder: Path, default: int) -> int:
    """The model's `lora_cache_sets` parameter (its config.pbtxt, one folder above the version), else `default`."""
    from .served_memory import config_parameter

    value = config_parameter(model_folder, CACHE_SETS_PARAMETER)
    return max(1, int(value)) if value and value.isdigit() else default


def lora_runner(folder: Path, name: str, weights: Mapping[str, Any], base: Any) -> TensorRTLoraRunner:
    """The runner of one LoRA set (`weights`: torch parameter name -> fused value) over the instance's base runner."""
    from safetensors.numpy import load_file

    from ...lora import RefitMap, refit_weights_for_tensorrt
    from ...lora.refit_map import REFIT_MAP_FILE
    from ..lora_switch import BASE_FILE, DEFAULT_CAPACITY, FOLDER
    from .runner import TensorRTRunner

    folder = Path(folder)
    manifest = EngineManifest.read(manifest_path(folder / PACKAGED_PLAN))
    reason = lora_unservable_reason(manifest.flags, name)
    if reason:
        raise ServeError(f"LoRA per request refused: {reason}; package the repository again")
    if not isinstance(base, TensorRTRunner):
        raise ServeError(f"{name}: a TensorRT LoRA set runs on the instance's TensorRT runner, got {type(base).__name__}")
    refit_map = RefitMap.load(folder / REFIT_MAP_FILE)
    refit_map.check_onnx_sha256(manifest.onnx_sha256, f"the ONNX {name} was built from")
    if base.serving_loras is False:  # first set of this instance: the base values every set may need back
        base.serve_loras(refit_weights_for_tensorrt(refit_map, load_file(str(folder / FOLDER / BASE_FILE))),
                         resident_sets=cache_sets(folder.parent, DEFAULT_CAPACITY))
    return TensorRTLoraRunner(base, refit_weights_for_tensorrt(refit_map, weights))
