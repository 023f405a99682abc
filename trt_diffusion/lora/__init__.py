"""LoRA for built engines: read LoRA files (diffusers/PEFT, kohya and Wan's original naming), compute the fused weights,
map them onto ONNX initializers (refit maps) and refit the onnxruntime target; the TensorRT target
consumes `refit_weights_for_tensorrt`.
"""

from .components import pipeline_lora_weights
from .deltas import LoraWithScale, base_parameters, lora_deltas
from .files import LoraFile, LoraNaming, read_lora_file
from .naming import LoraLayer, lora_layers
from .onnxruntime_refit import OnnxRuntimeRefitter, apply_refit_onnxruntime, onnxruntime_session, restore_base
from .refit_base import externalize_weights
from .refit_map import REFIT_MAP_FILE, MatchedBy, RefitMap, RefitTarget, build_refit_map
from .refit_weights import refit_arrays, refit_weights_for_tensorrt

__all__ = [
    "REFIT_MAP_FILE",
    "LoraFile",
    "LoraLayer",
    "LoraNaming",
    "LoraWithScale",
    "MatchedBy",
    "OnnxRuntimeRefitter",
    "RefitMap",
    "RefitTarget",
    "apply_refit_onnxruntime",
    "base_parameters",
    "build_refit_map",
    "externalize_weights",
    "lora_deltas",
    "lora_layers",
    "onnxruntime_session",
    "pipeline_lora_weights",
    "read_lora_file",
    "refit_arrays",
    "refit_weights_for_tensorrt",
    "restore_base",
]
