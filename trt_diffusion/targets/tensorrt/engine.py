"""The TensorRT target: build, load, run and refit one engine per EngineSpec — the entry points, one module per job.

The modules that call TensorRT, each importing `tensorrt` only inside functions (importing any of them needs
neither TensorRT nor a GPU; `tensorrt_available()` says why a host cannot build):

- `host_probe.py`: the `tensorrt` module and the CUDA devices this host has, or why not;
- `trt_log.py`: TensorRT's log, forwarded to `logging`, its recent errors quoted in ours;
- `builder.py`: strongly typed builds on TensorRT 10 and 11 (precision from the ONNX: build_flags.BuildFlags);
- `plan_load.py`: a plan deserialized after its manifest, bytes and host are checked; `run_engine`;
- `refit.py`: refit from host arrays, the base ONNX, device-resident sets, fp8/int8 with their scales.

Every decision (flags, profile checks, manifests, compatibility, the hardware gate) lives in the pure modules beside
them (build_flags, precision, host_gates, manifest, feeds, refit_weights, ...); these carry them out through
TensorRT's own API (Builder, OnnxParser, Runtime, Refitter, OnnxParserRefitter), typed against the TensorRT stubs:
tests/targets/test_tensorrt_typecheck.py runs mypy over every module here, so a misspelled or removed TensorRT name
fails the default test suite. The production runner is runner.py.
"""

from __future__ import annotations

from .builder import EngineSizes, build_engine, check_can_build, total_weights_bytes
from .host_probe import INSTALL_HINT, CudaDevice, HostInfo, host_info, require_tensorrt, tensorrt_available
from .plan_load import TensorRTEngine, load_engine, run_engine
from .refit import (
    REFIT_THREADS,
    DeviceWeights,
    refit_engine,
    refit_engine_on_device,
    refit_from_base,
    refit_prototypes,
    refit_quantized_from_base,
    refit_to_base,
    refittable_weight_names,
    serialize_refitted,
)

__all__ = [
    "INSTALL_HINT", "REFIT_THREADS", "CudaDevice", "DeviceWeights", "EngineSizes", "HostInfo", "TensorRTEngine",
    "build_engine", "check_can_build", "host_info", "load_engine", "refit_engine", "refit_engine_on_device",
    "refit_from_base", "refit_prototypes", "refit_quantized_from_base", "refit_to_base", "refittable_weight_names",
    "require_tensorrt", "run_engine", "serialize_refitted", "tensorrt_available", "total_weights_bytes",
]
