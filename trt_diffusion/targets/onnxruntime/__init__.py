"""The `onnxruntime` target: one fixed-shape, offline-optimized ONNX per engine shape, run by ONNX Runtime
(CPU here; CUDA where onnxruntime-gpu is installed), LoRA refit by replacing a refittable engine's external
initializers when its session is created, and Triton models (python backend, or the native onnxruntime one).

`engine.py` builds and seals an engine folder, `runner.py` runs one, `target.py` is the protocol over both.
"""

from .target import OnnxRuntimeTarget

__all__ = ["OnnxRuntimeTarget"]
