"""Refit: weights written into a refittable engine in place — from host arrays, from the base ONNX (every weight
TensorRT can refit, through OnnxParserRefitter), from device-resident sets (the LoRA hot swap, queued on the serving
runner's stream), fp8/int8 weights with their recomputed scales — and a refitted plan serialized with its weights."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...errors import RefitError
from . import host_probe, trt_log
from .dtypes import trt_dtype_name
from .refit_weights import prepare_refit_weights, weights_for_refit

if TYPE_CHECKING:  # TensorRT's own types (tensorrt-stubs in the test extra)
    import tensorrt as trt

    from .plan_load import TensorRTEngine

REFIT_THREADS = max(1, min(8, (os.cpu_count() or 1)))


def _refitter(engine: TensorRTEngine, *, base_only: bool = False) -> trt.Refitter:
    """A Refitter over the engine. A stripped plan built without REFIT is REFIT_IDENTICAL: TensorRT may refit it
    only with the very weights it was built from (`base_only`: restoring them from its ONNX); anything else is
    undefined behaviour there (NvInferRuntime.h, kREFIT_IDENTICAL), so a LoRA is refused."""
    flags = engine.manifest.flags
    if not flags.get("refit"):
        if not flags.get("strip_plan"):
            raise RefitError(f"engine {engine.manifest.spec_name} was not built refittable (refittable: false in its "
                             "spec)")
        if not base_only:
            raise RefitError(
                f"engine {engine.manifest.spec_name} is a stripped plan built REFIT_IDENTICAL (strip_plan without "
                "refittable): TensorRT refits it only with the weights it was built from, never a LoRA; mark the "
                "component refittable (REFIT) to refit other weights")
    host_probe.require_tensorrt()
    import tensorrt as trt

    refitter = trt.Refitter(engine.engine, trt_log.trt_logger())
    refitter.max_threads = REFIT_THREADS  # weights validated and copied in parallel (hot swap on a serving host)
    return refitter


def refittable_weight_names(engine: TensorRTEngine) -> list[str]:
    """Names (ONNX initializer names) of every weight the engine can refit."""
    return sorted(name for name in _refitter(engine).get_all_weights() if name)


def _prototypes(refitter: trt.Refitter, names: Iterable[str]) -> dict[str, tuple[str, int]]:
    prototypes = {}
    for name in names:
        prototype = refitter.get_weights_prototype(name)
        prototypes[name] = (trt_dtype_name(prototype.dtype), int(prototype.size))
    return prototypes


def _as_trt_weights(refitter: trt.Refitter, name: str, array: np.ndarray) -> trt.Weights:
    # by pointer, typed as the engine's own weights: no numpy-to-TensorRT dtype mapping (bfloat16 has
    # none); `array` must stay alive until refit_cuda_engine returns, as Weights do not copy
    import tensorrt as trt

    return trt.Weights(refitter.get_weights_prototype(name).dtype, array.ctypes.data, array.size)


def _set_named_weights(refitter: trt.Refitter, prepared: Mapping[str, np.ndarray], engine_name: str) -> None:
    rejected = [
        name for name, array in prepared.items()
        if not refitter.set_named_weights(name, _as_trt_weights(refitter, name, array))
    ]
    if rejected:
        raise RefitError(f"TensorRT rejected weight(s) {rejected} for engine {engine_name}")


def _refit_cuda_engine(engine: TensorRTEngine, refitter: trt.Refitter, written: Iterable[str],
                       stream_handle: int | None = None) -> None:
    """`refit_cuda_engine`, or with `stream_handle` `refit_cuda_engine_async` on the stream every run of the
    engine is queued on (a serving runner's: ordered after the runs already queued, no host sync)."""
    name = engine.manifest.spec_name
    missing = sorted(n or "<unnamed>" for n in refitter.get_missing_weights())
    if missing:
        raise RefitError(
            f"cannot refit engine {name}: TensorRT also needs weight(s) {missing} "
            "(fused with the ones given); pass base_weights or include them"
        )
    mark = trt_log.ERRORS.mark()
    done = refitter.refit_cuda_engine() if stream_handle is None else refitter.refit_cuda_engine_async(stream_handle)
    if not done:
        # TensorRT may have written some of them: count all as changed so a restore covers them
        engine.refitted_names |= set(written)
        raise RefitError(trt_log.with_trt_errors(f"TensorRT failed to refit engine {name}", mark))


@dataclass(frozen=True)
class DeviceWeights:
    """Refit weights held in GPU memory (uploaded once, cast to the engine's dtype): `count` elements at `pointer`."""

    pointer: int
    count: int
    nbytes: int


def _device_refitter(engine: TensorRTEngine) -> trt.Refitter:
    """One Refitter per loaded engine for its device-resident hot swaps (not one per swap): every weight name it
    was ever given points at memory still held (a resident set or a base copy: each swap re-sets every name the
    last one changed)."""
    if engine.device_refitter is None:
        refitter = _refitter(engine)
        # the runner checked every value finite when it uploaded it (refit_weights.check_finite_weights):
        # TensorRT's own validation would read the device weights again on every swap
        refitter.weights_validation = False
        engine.device_refitter = refitter
    return engine.device_refitter


def refit_prototypes(engine: TensorRTEngine, names: Iterable[str]) -> dict[str, tuple[str, int]]:
    """(dtype name, element count) of each named weight as the engine holds it (count -1: no such weight)."""
    return _prototypes(_device_refitter(engine), names)


def serialize_refitted(engine: TensorRTEngine, *, with_weights: bool) -> trt.IHostMemory:
    """The plan of a refitted engine. A plan built with STRIP_PLAN keeps EXCLUDE_WEIGHTS in its default
    serialization config (NvInferRuntime.h, SerializationFlag): `serialize()` would save it stripped again, and
    its load would refit the base weights from the ONNX over the LoRA. `with_weights` (a LoRA was refitted):
    the weights are saved in the plan (EXCLUDE_WEIGHTS cleared, as TensorRT-LLM and demo/Diffusion do); the
    manifest's refit record then says the plan holds them (`EngineManifest.stripped` is False)."""
    import tensorrt as trt

    config = engine.engine.create_serialization_config()
    if with_weights:
        config.clear_flag(trt.SerializationFlag.EXCLUDE_WEIGHTS)
    mark = trt_log.ERRORS.mark()
    plan = engine.engine.serialize_with_config(config)
    if plan is None:
        raise RefitError(trt_log.with_trt_errors(f"TensorRT could not serialize the refitted engine "
                                          f"{engine.manifest.spec_name}", mark))
    return plan


def refit_engine_on_device(
    engine: TensorRTEngine,
    weights: Mapping[str, DeviceWeights],
    stream_handle: int,
    changed: Iterable[str],
    fill: Callable[[list[str]], Mapping[str, DeviceWeights]] | None = None,
) -> None:
    """LoRA hot swap from device-resident weights: each weight given by its device pointer
    (`set_named_weights(..., TensorLocation.DEVICE)`), then `refit_cuda_engine_async` on the stream every run of
    the engine is queued on — nothing is copied from the host. `fill(names)` gives device weights for weights
    TensorRT fused with the given ones (their base values). `changed`: the names that now differ from base.
    The device memory must stay allocated until the refit has run on the stream (free it on that stream's
    order: after a synchronize)."""
    import tensorrt as trt

    name = engine.manifest.spec_name
    refitter = _device_refitter(engine)

    def put(items: Mapping[str, DeviceWeights]) -> None:
        rejected = []
        for weight, held in items.items():  # typed as the engine's own weights (uploaded already cast to them)
            prototype = refitter.get_weights_prototype(weight)
            if int(prototype.size) != held.count or not refitter.set_named_weights(
                    weight, trt.Weights(prototype.dtype, held.pointer, held.count), trt.TensorLocation.DEVICE):
                rejected.append(weight)
        if rejected:
            raise RefitError(f"TensorRT rejected device weight(s) {rejected} for engine {name}")

    put(weights)
    missing = [n for n in refitter.get_missing_weights() if n]
    if missing and fill is not None:
        put(fill(missing))
    _refit_cuda_engine(engine, refitter, weights, stream_handle)
    engine.refitted_names = set(changed)


def refit_engine(
    engine: TensorRTEngine,
    weights: Mapping[str, np.ndarray],
    base_weights: Mapping[str, np.ndarray] | None = None,
    stream_handle: int | None = None,
) -> None:
    """Write new weights (by ONNX initializer name) into a refittable engine, in place.

    With `base_weights`, weights changed by an earlier refit but absent here return to base in
    the same refit, and weights TensorRT fused with the given ones are filled from base. Without
    them, any such weight is a RefitError rather than a silent residue. (`refit_from_base` restores
    every weight from the ONNX file instead: what `trt-diffusion refit` uses.)
    """
    name = engine.manifest.spec_name
    wanted = weights_for_refit(name, engine.refitted_names, weights, base_weights)
    if not wanted:
        return
    refitter = _refitter(engine)
    # `prepared` holds the arrays TensorRT reads from until refit_cuda_engine returns (Weights do not copy)
    prepared = prepare_refit_weights(name, _prototypes(refitter, wanted), wanted)
    _set_named_weights(refitter, prepared, name)
    prepared.update(_fill_missing_weights(refitter, name, base_weights))
    _refit_cuda_engine(engine, refitter, wanted, stream_handle)
    engine.refitted_names = set(weights)


def _fill_missing_weights(
    refitter: trt.Refitter, engine_name: str, base_weights: Mapping[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    missing = [n for n in refitter.get_missing_weights() if n]
    if not missing or base_weights is None:
        return {}
    fill = {n: base_weights[n] for n in missing if n in base_weights}
    prepared = prepare_refit_weights(engine_name, _prototypes(refitter, fill), fill)
    _set_named_weights(refitter, prepared, engine_name)
    return prepared


def refit_to_base(
    engine: TensorRTEngine,
    base_weights: Mapping[str, np.ndarray],
    names: Iterable[str] | None = None,
    stream_handle: int | None = None,
) -> None:
    """Restore base weights: by default those refitted since the plan was built (its manifest's record
    and this process's refits); pass `names=refittable_weight_names(engine)` to restore everything.
    `stream_handle`: queued on that stream (a serving runner's), as `refit_engine` does: the synchronous refit is
    undefined while the engine has work queued (NvInferRuntime.h, IRefitter::refitCudaEngine)."""
    restore = sorted(engine.refitted_names if names is None else set(names))
    absent = [n for n in restore if n not in base_weights]
    if absent:
        raise RefitError(f"cannot restore engine {engine.manifest.spec_name}: the base weights lack {absent[:10]}")
    refit_engine(engine, {n: base_weights[n] for n in restore}, base_weights, stream_handle=stream_handle)
    engine.refitted_names = set()


def refit_quantized_from_base(
    engine: TensorRTEngine,
    base_onnx: str | Path,
    weights: Mapping[str, np.ndarray],
) -> None:
    """An fp8/int8 engine: every refittable weight from the base ONNX, then the LoRA'd weights *with their
    recomputed weight scales* (`lora.quantized_refit`: float weights and float8 codes, scales as Constant or
    initializer names) over them, in one refit; the calibrated activation scales are left as built.

    A weight or scale the engine cannot refit by name (TensorRT folded it into a kernel) is refused, naming
    them: a refit of the weight without its scale would keep the base weight's range.
    """
    import tensorrt as trt

    name = engine.manifest.spec_name
    refitter = _refitter(engine, base_only=not weights)
    absent = sorted(set(weights) - set(refitter.get_all_weights()))
    if absent:
        raise RefitError(f"cannot refit the quantized engine {name}: TensorRT has no refittable weight named "
                         f"{absent[:5]}{' ...' if len(absent) > 5 else ''} ({len(absent)} in all); rebuild it with the "
                         "LoRA fused and recalibrated (mode: fused)")
    codes = {n: a for n, a in weights.items() if a.dtype.name == "float8_e4m3fn"}
    others = {n: a for n, a in weights.items() if n not in codes}
    parser_refitter = trt.OnnxParserRefitter(refitter, trt_log.trt_logger())
    mark = trt_log.ERRORS.mark()
    if not parser_refitter.refit_from_file(str(base_onnx)):
        said = [trt_log.parser_error_text(parser_refitter.get_error(i)) for i in range(parser_refitter.num_errors)]
        raise RefitError(trt_log.with_trt_errors(
            f"cannot restore engine {name} from {base_onnx}: " + ("; ".join(said) or "the ONNX refitter gave no reason"),
            mark))
    # `prepared` and `parser_refitter` hold the weights TensorRT reads until refit_cuda_engine returns
    prepared = prepare_refit_weights(name, _prototypes(refitter, others), others) if others else {}
    _set_named_weights(refitter, prepared, name)
    for weight, array in codes.items():  # float8 codes: numpy has no FP8 dtype, TensorRT takes the bytes
        prototype = refitter.get_weights_prototype(weight)
        if prototype.dtype != trt.DataType.FP8 or int(prototype.size) != array.size:
            raise RefitError(f"cannot refit engine {name}: {weight} is held as {trt_dtype_name(prototype.dtype)} x "
                             f"{int(prototype.size)}, the refit gives float8 x {array.size}")
        raw = np.ascontiguousarray(array).view(np.uint8)
        prepared[weight] = raw
        if not refitter.set_named_weights(weight, trt.Weights(trt.DataType.FP8, raw.ctypes.data, raw.size)):
            raise RefitError(f"TensorRT rejected weight {weight} for engine {name}")
    _refit_cuda_engine(engine, refitter, refitter.get_all_weights())
    del parser_refitter
    engine.refitted_names = set(prepared)


def refit_from_base(
    engine: TensorRTEngine,
    base_onnx: str | Path,
    weights: Mapping[str, np.ndarray] | None = None,
    stream_handle: int | None = None,
) -> None:
    """Every refittable weight from the base ONNX, then `weights` over them, in one refit.

    `OnnxParserRefitter.refit_from_file` sets each weight the engine can refit from the ONNX the plan was
    built from: initializers, Constant-node values and the weights the parser itself made (folded or fused
    ones that have no initializer of their own), which no list of ONNX initializers covers. So nothing of
    an earlier LoRA can stay behind, whatever the manifest says. `weights` (ONNX initializer names, e.g.
    LoRA-fused weights) then replace their base values before `refit_cuda_engine`.
    """
    import tensorrt as trt

    name = engine.manifest.spec_name
    refitter = _refitter(engine, base_only=not weights)
    parser_refitter = trt.OnnxParserRefitter(refitter, trt_log.trt_logger())
    mark = trt_log.ERRORS.mark()
    if not parser_refitter.refit_from_file(str(base_onnx)):
        said = [trt_log.parser_error_text(parser_refitter.get_error(i)) for i in range(parser_refitter.num_errors)]
        raise RefitError(trt_log.with_trt_errors(
            f"cannot restore engine {name} from {base_onnx}: " + ("; ".join(said) or "the ONNX refitter gave no reason")
            + " (is it the ONNX the engine was built from?)", mark))
    # `prepared` and `parser_refitter` hold the weights TensorRT reads until refit_cuda_engine returns
    prepared = prepare_refit_weights(name, _prototypes(refitter, weights), weights) if weights else {}
    _set_named_weights(refitter, prepared, name)
    _refit_cuda_engine(engine, refitter, refitter.get_all_weights(), stream_handle)
    del parser_refitter
    engine.refitted_names = set(prepared)
