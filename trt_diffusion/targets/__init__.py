"""Targets: one module per backend behind one protocol (`base.Target`).

The registry that knows them by name is `trt_diffusion.target_registry` (re-exported here); it imports a
target's module on first use, so listing the targets imports no runtime. `targets/tensorrt/` is the only
importer of `tensorrt`, `targets/onnxruntime/` of `onnxruntime` for building; no module outside this package
compares a target's name.
"""

from __future__ import annotations

from ..target_registry import (
    availability,
    check_target_name,
    default_target_names,
    get_target,
    register_target,
    target_names,
    unregister_target,
)
from .base import BuildRequest, BuiltEngine, Target, TargetBase, TritonEngineModel

__all__ = [
    "BuildRequest", "BuiltEngine", "Target", "TargetBase", "TritonEngineModel",
    "availability", "check_target_name", "default_target_names", "get_target", "register_target", "target_names",
    "unregister_target",
]
