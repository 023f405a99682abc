"""The `tensorrt` target: one strongly typed `.plan` per EngineSpec, refittable for LoRAs.

The decisions that need no TensorRT are pure Python, tested on CPU, one module per job: `build_flags.py` (the
builder settings of an engine), `precision.py` (the ONNX each precision is built from), `host_gates.py` (what a
GPU or TensorRT release refuses before TensorRT starts), `versions.py`, `timing_cache.py`, `manifest.py` (the
engine manifest, its paths, when a plan is current), `feeds.py` (inputs at run time), `refit_weights.py` and
`dtypes.py`, with `served_memory.py` (GPU memory once served) and `lora_serving.py` (LoRA per request). The modules
that call TensorRT, one per job, import `tensorrt` only inside functions (importing this package needs neither
TensorRT nor a GPU): `host_probe.py` (what this host has), `trt_log.py` (TensorRT's log), `builder.py` (build),
`plan_load.py` (load and run), `refit.py`; `engine.py` re-exports their entry points. The production runner is
`runner.py` with `engine_group.py` (the engines of one pipeline on one GPU). The target class is `target.py`.
"""

from .target import OPTIONAL_SETTINGS, TensorRTTarget

__all__ = ["OPTIONAL_SETTINGS", "TensorRTTarget"]
