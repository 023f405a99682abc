"""The `tensorrt` target: one strongly typed `.plan` per EngineSpec, refittable for LoRAs.

The decisions that need no TensorRT are pure Python, tested on CPU, one module per job: `build_flags.py` (the
builder settings of an engine), `precision.py` (the ONNX each precision is built from), `host_gates.py` (what a
GPU or TensorRT release refuses before TensorRT starts), `versions.py`, `timing_cache.py`, `manifest.py` (the
engine manifest, its paths, when a plan is current), `feeds.py` (inputs at run time), `refit_weights.py` and
`dtypes.py`. `engine.py` is the only module of trt-diffusion that imports
`tensorrt`, inside functions, so importing this package needs neither TensorRT nor a GPU. The target class is
`target.py`.
"""

from .target import OPTIONAL_SETTINGS, TensorRTTarget

__all__ = ["OPTIONAL_SETTINGS", "TensorRTTarget"]
