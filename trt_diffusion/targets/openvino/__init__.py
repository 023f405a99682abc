"""The `openvino` target: OpenVINO IR per engine shape for CPUs, with honest precision (bf16 only where the
CPU computes it, int8 from the Q/DQ ONNX), a compiled-model cache per OpenVINO version and CPU, LoRA refit
by replacing weight constants, and Triton models (python backend, or the native openvino backend).

This package is the only importer of `openvino`; it imports it only inside the functions that need it.
"""

from .target import OpenVINOTarget

__all__ = ["OpenVINOTarget"]
