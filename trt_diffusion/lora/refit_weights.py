"""Torch parameter values -> the arrays to write into ONNX initializers / engine weights, through a refit map."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..errors import RefitError
from ..precision import float_dtype
from .quantized_refit import quantized_arrays
from .refit_map import UNUSED_BY_GRAPH, RefitMap


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype for `float16`, `fp16`, `bfloat16` (through ml_dtypes, which onnx brings)..."""
    name = float_dtype(name) or name
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise RefitError(f"cannot refit weights as {name}: numpy has no such dtype") from None


def _as_fp32_numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float().numpy()
    return np.asarray(value, dtype=np.float32)


def _shared_problems(refit_map: RefitMap, weights: Mapping, arrays: Mapping[str, np.ndarray]) -> list[str]:
    problems = []
    for init, params in refit_map.shared_initializers().items():
        if init not in arrays:
            continue
        given = [p for p in params if p in weights]
        values = [_as_fp32_numpy(weights[p]) for p in given]
        if len(given) != len(params) or any(not np.array_equal(values[0], v) for v in values[1:]):
            problems.append(f"{init} holds {params} (deduplicated by the exporter); they would need the same new value")
    return problems


def refit_arrays(
    refit_map: RefitMap, weights: Mapping[str, torch.Tensor | np.ndarray], dtype: str | None = None
) -> dict[str, np.ndarray]:
    """Initializer name -> contiguous array, transposed and reshaped as the map says, cast to `dtype`
    (default: the initializer's own dtype). One RefitError lists every weight that cannot be placed."""
    arrays: dict[str, np.ndarray] = {}
    problems = []
    for param, value in weights.items():
        target = refit_map.targets.get(param)
        if target is None and refit_map.unmapped.get(param) == UNUSED_BY_GRAPH:
            continue  # a step cache's piece: the weight is its model's, not this graph's
        if target is None:
            reason = refit_map.unmapped.get(param, "not a parameter of the model the map was built for")
            problems.append(f"{param}: {reason}")
            continue
        array = _as_fp32_numpy(value)
        if target.quantization is not None:  # fp8/int8: the weight as stored and its recomputed scale
            if array.size != int(np.prod(target.shape)):
                problems.append(f"{param}: {array.size} values (shape {array.shape}), {target.initializer} holds "
                                f"{target.shape}")
                continue
            arrays.update(quantized_arrays(target, array.reshape(
                target.shape[::-1] if target.transpose else target.shape)))
            continue
        if target.transpose:
            array = array.T
        if array.size != int(np.prod(target.shape)):
            problems.append(f"{param}: {array.size} values (shape {array.shape}), {target.initializer} holds "
                            f"{target.shape}")
            continue
        arrays[target.initializer] = np.ascontiguousarray(array.reshape(target.shape),
                                                          dtype=numpy_dtype(dtype or target.dtype))
    problems += _shared_problems(refit_map, weights, arrays)
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise RefitError(f"cannot place {len(problems)} weight(s) in the ONNX/engine:\n  {shown}{more}")
    return arrays


def refit_weights_for_tensorrt(
    refit_map: RefitMap, weights: Mapping[str, torch.Tensor | np.ndarray], precision: str | None = None
) -> dict[str, np.ndarray]:
    """What `targets.tensorrt.engine.refit_engine(engine, weights, base_weights)` consumes: ONNX initializer
    name -> array, transposed where the map says, as `precision` (fp32/fp16/bf16; default the ONNX's own).

    `weights` are full fused values (from `lora_deltas`), not differences. Pass the engine's base weights
    to `refit_engine` too, so that weights an earlier LoRA changed and this one does not go back to base.
    """
    return refit_arrays(refit_map, weights, dtype=precision)
