"""GPU memory a TensorRT engine takes once served: weights and activations, per context and per instance.

Pure decisions, tested on CPU (tests/targets/test_tensorrt_served_memory.py); the figures come from the manifest
(read back from the engine at build time: engine.EngineSizes).

Activations. Triton's TensorRT backend (tensorrt_backend, `instance_state.cc`) makes one execution context per
optimization profile an instance lists, each with its own activation memory. With the default allocation strategy
(STATIC) every context holds `device_memory_size_v2`, the largest over ALL profiles: a plan with N profiles takes
N × the largest per instance. `execution_context_allocation_strategy: ON_PROFILE_CHANGE` (set by `package` for
multi-profile plans, `TRITON_STRATEGY`) makes each context hold only its own profile's size
(`get_device_memory_size_for_profile_v2`): the sum over the profiles. trt-diffusion's own runner (python-backend
models: stripped plans, LoRA per request) makes one context per engine with USER_MANAGED memory shared by the
engines of a group: one `device_memory_size_v2` per instance. Neither is shared between Triton instances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STRATEGY_PARAMETER = "execution_context_allocation_strategy"
TRITON_STRATEGY = "ON_PROFILE_CHANGE"
STRATEGIES = ("STATIC", "ON_PROFILE_CHANGE", "USER_MANAGED")


def triton_parameters(profiles: int) -> dict[str, str]:
    """The tensorrt_plan model parameters of a plan with `profiles` optimization profiles: a multi-profile plan's
    contexts each hold only their own profile's activations."""
    return {STRATEGY_PARAMETER: TRITON_STRATEGY} if profiles > 1 else {}


def activation_bytes_per_instance(manifest: Any, backend: str, strategy: str | None = None) -> int:
    """Activation memory one served instance of this engine holds. `manifest`: an EngineManifest or its JSON dict;
    `backend`: "tensorrt_plan" (Triton's TensorRT backend) or "python" (trt-diffusion's runner); `strategy`: the
    model's execution_context_allocation_strategy (None: Triton's default, STATIC)."""
    get = manifest.get if isinstance(manifest, dict) else lambda key, default=None: getattr(manifest, key, default)
    largest = int(get("device_memory_bytes") or 0)
    per_profile = [int(b) for b in (get("profile_device_memory_bytes") or ())]
    profiles = max(len(get("profiles") or ()), 1)
    if backend != "tensorrt_plan":
        return largest  # one context, its memory shared by the engines of the runner's group
    if strategy == "ON_PROFILE_CHANGE":
        return sum(per_profile) if len(per_profile) == profiles else profiles * largest
    return profiles * largest  # STATIC: every context the largest over all profiles


def packaged_activation_bytes(model_folder: str | Path, backend: str) -> int:
    """A packaged TensorRT engine model's activation memory per instance: its version folders' manifest.json and
    the allocation strategy its config.pbtxt sets."""
    import json

    strategy = config_parameter(model_folder, STRATEGY_PARAMETER)
    total = 0
    for version in (v for v in Path(model_folder).iterdir() if v.is_dir()):
        try:
            manifest = json.loads((version / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict):
            total = max(total, activation_bytes_per_instance(manifest, backend, strategy))
    return total


def onnx_weight_bytes(onnx_path: str | Path) -> int:
    """Bytes of every weight of an ONNX (initializers, external data included, and Constant values), read from its
    structure alone: what a stripped plan holds on the GPU once its weights are refitted from that ONNX."""
    import numpy as np
    import onnx
    from onnx import helper

    from ...onnx_facts import load_onnx_structure

    model = load_onnx_structure(onnx_path)

    def nbytes(tensor: onnx.TensorProto) -> int:
        count = 1
        for dim in tensor.dims:
            count *= int(dim)
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        except (KeyError, TypeError, ValueError):
            itemsize = 1  # 4-bit and other packed types: at most a byte each
        return count * itemsize

    total = sum(nbytes(t) for t in model.graph.initializer)
    for node in model.graph.node:
        if node.op_type == "Constant":
            total += sum(nbytes(a.t) for a in node.attribute if a.type == onnx.AttributeProto.TENSOR)
    return total


# ---------------------------------------------------------------------------------------------- weight streaming

WEIGHT_BUDGET_PARAMETER = "tensorrt_weight_budget_bytes"  # a python-backend engine model's config.pbtxt parameter
GIB = 1 << 30


def serving_weight_budget(serving: Any) -> int | None:
    """engines.yaml's `serving: tensorrt_weight_budget_gb` in bytes (None: no budget, every weight resident)."""
    budget = getattr(serving, "tensorrt_weight_budget_gb", None)
    return None if budget is None else int(budget * GIB)


def config_parameter(model_folder: str | Path, key: str) -> str | None:
    """A string parameter of a Triton model's config.pbtxt (the folder above the version), None when absent."""
    import re

    try:
        text = (Path(model_folder) / "config.pbtxt").read_text()
    except OSError:
        return None
    found = re.search(r'key:\s*"' + re.escape(key) + r'"\s*value\s*:?\s*\{\s*string_value:\s*"([^"]*)"', text)
    return found.group(1) if found else None


def packaged_weight_budget(model_folder: str | Path) -> int | None:
    """The weight budget `package` wrote for a python-backend TensorRT engine model (None: none)."""
    from ...errors import ServeError

    value = config_parameter(model_folder, WEIGHT_BUDGET_PARAMETER)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise ServeError(f"{model_folder}/config.pbtxt: {WEIGHT_BUDGET_PARAMETER} must be a byte count, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------- plan


def plan_activations(workspace: str | Path, specs: Any) -> dict[str, int | None]:
    """Activation memory of one `plan` row's engines once served, per instance: Triton's TensorRT backend (a context
    per optimization profile, ON_PROFILE_CHANGE as `package` sets it for multi-profile plans; one per per-shape
    engine) and trt-diffusion's runner (one context per engine, one allocation shared by the engines of a group:
    the largest). Bytes come from the built engines' manifests; None until every engine of the row is built."""
    from .manifest import EngineManifest, engine_path, manifest_path

    specs = list(specs)
    manifests = []
    for spec in specs:
        try:
            manifest = EngineManifest.read(manifest_path(engine_path(Path(workspace), spec)))
        except Exception:  # noqa: BLE001 - not built (or unreadable): no figure yet
            continue
        if manifest.spec_key == spec.key:
            manifests.append(manifest)
    built = len(manifests) == len(specs) and all(m.device_memory_bytes is not None for m in manifests)
    triton = sum(activation_bytes_per_instance(m, "tensorrt_plan", TRITON_STRATEGY if m.profiles else None)
                 for m in manifests) if built else None
    return {"triton_contexts": sum(len(spec.members) if spec.profiles else 1 for spec in specs),
            "triton_activation_bytes": triton,
            "runner_contexts": len(specs),
            "runner_activation_bytes": max(int(m.device_memory_bytes or 0) for m in manifests) if built else None}
