"""TensorRT build decisions that need no TensorRT: profiles, flags, manifests, compatibility, paths.

Everything here is pure Python (numpy, onnx, pydantic) so it is tested on CPU machines; the module
that talks to TensorRT (`engine.py`) only carries these decisions out.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...errors import BuildError, RefitError, RuntimeInputError
from ...spec.engine_spec import EngineSpec
from ..onnx_facts import (  # noqa: F401  (re-exported: the TensorRT build's ONNX facts)
    ProfileShapes,
    Shape,
    TensorInfo,
    atomic_write_bytes,
    check_profile_against_inputs,
    onnx_has_qdq,
    onnx_input_shapes,
    onnx_sha256,
    read_base_weights,
    validate_profile,
)

TARGET = "tensorrt"
MANIFEST_SCHEMA_VERSION = 1
REBUILD_COMMAND = "trt-diffusion build engines.yaml --target tensorrt"
GIB = 1 << 30

KNOWN_PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "int8")
QUANTIZED_PRECISIONS = ("fp8", "int8")

# TensorRT DataType member name -> the dtype name written in manifests (numpy's name where numpy has one)
TRT_DTYPE_NAMES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "UINT8": "uint8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "FP8": "float8e4m3",
    "INT4": "int4",
    "FP4": "float4e2m1",
    "E8M0": "float8e8m0",
}


# ----------------------------------------------------------------------------------------------
# Builder flags
# ----------------------------------------------------------------------------------------------


def _option_int(spec: EngineSpec, name: str, default: int, low: int, high: int) -> int:
    value = spec.option(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BuildError(f"{spec.name}: build option {name} must be an integer from {low} to {high}, got {value!r}")
    return value


def _option_workspace_bytes(spec: EngineSpec) -> int:
    value = spec.option("tensorrt_workspace_gb", 8)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise BuildError(f"{spec.name}: build option tensorrt_workspace_gb must be a positive number, got {value!r}")
    return int(value * GIB)


def _check_precision(spec: EngineSpec, has_qdq: bool) -> None:
    precision = spec.precision
    if precision not in KNOWN_PRECISIONS:
        raise BuildError(f"{spec.name}: unknown precision {precision!r} (known: {', '.join(KNOWN_PRECISIONS)})")
    quantized = precision in QUANTIZED_PRECISIONS
    if quantized and not has_qdq:
        raise BuildError(
            f"{spec.name}: precision {precision} needs an ONNX with Q/DQ nodes from the quantize stage; this ONNX has none"
        )
    if has_qdq and not quantized:
        raise BuildError(
            f"{spec.name}: the ONNX carries Q/DQ nodes but the engine's precision is {precision}; "
            "a quantized ONNX belongs to fp8/int8 engines"
        )
    if quantized and spec.refittable:
        raise BuildError(
            f"{spec.name}: {precision} engines are not refittable here; fuse LoRAs before quantization (mode: fused)"
        )


@dataclass(frozen=True)
class BuildFlags:
    """The builder settings of one engine, decided from its spec and its ONNX."""

    precision: str
    fp16: bool = False
    bf16: bool = False
    tf32: bool = True
    # Q/DQ networks: tensor types come from the graph, so no precision flag may be set
    strongly_typed: bool = False
    refit: bool = False
    strip_plan: bool = False
    version_compatible: bool = False
    builder_optimization_level: int = 3
    workspace_bytes: int = 8 * GIB

    @classmethod
    def for_spec(cls, spec: EngineSpec, onnx_has_qdq: bool) -> "BuildFlags":
        if spec.target != TARGET:
            raise BuildError(f"{spec.name}: target is {spec.target!r}, not {TARGET!r}")
        _check_precision(spec, onnx_has_qdq)
        return cls(
            precision=spec.precision,
            fp16=spec.precision == "fp16",
            bf16=spec.precision == "bf16",
            tf32=bool(spec.option("tensorrt_tf32", True)),  # off where fp32 must match a reference to 1e-4
            strongly_typed=onnx_has_qdq,
            refit=spec.refittable,
            version_compatible=bool(spec.option("tensorrt_version_compatible", False)),
            builder_optimization_level=_option_int(spec, "tensorrt_optimization_level", 3, 0, 5),
            workspace_bytes=_option_workspace_bytes(spec),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Versions, compute capabilities, paths
# ----------------------------------------------------------------------------------------------


def parse_trt_version(version: str) -> tuple[int, int, int]:
    """'10.13.0.35' -> (10, 13, 0): the part an engine is tied to (the fourth is the build number)."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not match:
        raise BuildError(f"not a TensorRT version: {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def sm_name(compute_capability: Sequence[int]) -> str:
    major, minor = compute_capability
    return f"sm_{major}{minor}"


def timing_cache_path(cache_dir: str | Path, compute_capability: tuple[int, int], trt_version: str) -> Path:
    """One timing cache per GPU compute capability and TensorRT major.minor: tactics timed on one
    architecture or TensorRT release say nothing about another."""
    major, minor, _ = parse_trt_version(trt_version)
    cc_major, cc_minor = compute_capability
    return Path(cache_dir) / f"sm{cc_major}{cc_minor}-trt{major}.{minor}.timing.cache"


def engine_path(workspace: str | Path, spec: EngineSpec) -> Path:
    """<workspace>/engines/tensorrt/<spec.name>.<spec.key>.plan (the key keeps same-named specs apart)."""
    return Path(workspace) / "engines" / TARGET / f"{spec.name}.{spec.key}.plan"


def manifest_path(plan_path: str | Path) -> Path:
    plan_path = Path(plan_path)
    stem = plan_path.name[: -len(".plan")] if plan_path.name.endswith(".plan") else plan_path.name
    return plan_path.with_name(f"{stem}.manifest.json")


# ----------------------------------------------------------------------------------------------
# The engine manifest
# ----------------------------------------------------------------------------------------------


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class EngineManifest(BaseModel):
    """What a .plan was built from and for; read before the plan is ever deserialized."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = MANIFEST_SCHEMA_VERSION
    spec_key: str
    spec_name: str
    target: str = TARGET
    tensorrt_version: str
    compute_capability: tuple[int, int]
    device_name: str
    flags: dict[str, Any]
    profile_shapes: dict[str, tuple[Shape, Shape, Shape]]
    onnx_sha256: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    refit_map: str | None = None
    plan_bytes: int
    build_seconds: float
    created_at: str = Field(default_factory=_utc_now)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "engine manifest") -> "EngineManifest":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise BuildError(f"{source} is not valid JSON ({err}): rebuild with `{REBUILD_COMMAND}`") from err
        version = raw.get("schema_version") if isinstance(raw, dict) else None
        if version != MANIFEST_SCHEMA_VERSION:
            raise BuildError(
                f"{source} has schema_version {version!r}; this trt-diffusion reads {MANIFEST_SCHEMA_VERSION}: "
                f"rebuild with `{REBUILD_COMMAND}`"
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise BuildError(f"{source} is malformed: {err}") from err

    def write(self, path: str | Path) -> None:
        atomic_write_bytes(path, self.to_json().encode())

    @classmethod
    def read(cls, path: str | Path) -> "EngineManifest":
        path = Path(path)
        if not path.is_file():
            raise BuildError(f"engine manifest {path} is missing: rebuild with `{REBUILD_COMMAND}`")
        return cls.from_json(path.read_text(), source=f"engine manifest {path}")

    def input(self, name: str) -> TensorInfo | None:
        return next((info for info in self.inputs if info.name == name), None)


def manifest_is_current(
    manifest: EngineManifest,
    spec: EngineSpec,
    onnx_digest: str,
    flags: BuildFlags,
    profile_shapes: ProfileShapes,
    trt_version: str,
    compute_capability: tuple[int, int],
) -> bool:
    """True when an existing engine was built from exactly these inputs on this kind of host:
    the only reason a build may be skipped."""
    return (
        manifest.spec_key == spec.key
        and manifest.onnx_sha256 == onnx_digest
        and manifest.flags == flags.to_dict()
        and manifest.profile_shapes == validate_profile(profile_shapes)
        and parse_trt_version(manifest.tensorrt_version) == parse_trt_version(trt_version)
        and tuple(manifest.compute_capability) == tuple(compute_capability)
    )


# ----------------------------------------------------------------------------------------------
# Compatibility between an engine and the host that loads it
# ----------------------------------------------------------------------------------------------


def _versions_compatible(built: str, runtime: str, version_compatible: bool) -> bool:
    built_version, runtime_version = parse_trt_version(built), parse_trt_version(runtime)
    if version_compatible:  # built with VERSION_COMPATIBLE: same major, same or newer runtime
        return built_version[0] == runtime_version[0] and runtime_version >= built_version
    return built_version == runtime_version


def check_engine_compatible(
    manifest: EngineManifest,
    runtime_trt_version: str,
    runtime_compute_capability: tuple[int, int],
    runtime_device_name: str | None = None,
) -> None:
    """Refuse an engine built for another TensorRT version or GPU architecture, before TensorRT
    fails to deserialize it with a message that names neither."""
    version_compatible = bool(manifest.flags.get("version_compatible", False))
    version_ok = _versions_compatible(manifest.tensorrt_version, runtime_trt_version, version_compatible)
    cc_ok = tuple(manifest.compute_capability) == tuple(runtime_compute_capability)
    if version_ok and cc_ok:
        return
    built = f"TensorRT {manifest.tensorrt_version} for {sm_name(manifest.compute_capability)} ({manifest.device_name})"
    host_device = f" ({runtime_device_name})" if runtime_device_name else ""
    host = f"TensorRT {runtime_trt_version} and {sm_name(runtime_compute_capability)}{host_device}"
    rules = []
    if not version_ok:
        rules.append(
            "a version-compatible engine loads only on the same TensorRT major version, at or after the one it was built with"
            if version_compatible
            else "a TensorRT engine loads only on the exact TensorRT version (major.minor.patch) it was built with"
        )
    if not cc_ok:
        rules.append("an engine runs only on GPUs of the compute capability it was built for")
    raise BuildError(
        f"engine {manifest.spec_name} was built with {built}; this host has {host}: {'; '.join(rules)}. "
        f"Rebuild on this host with `{REBUILD_COMMAND}`"
    )


# ----------------------------------------------------------------------------------------------
# Inputs at run time, weights at refit time
# ----------------------------------------------------------------------------------------------


def _expected_inputs(manifest: EngineManifest) -> str:
    lines = []
    for info in manifest.inputs:
        shapes = manifest.profile_shapes.get(info.name)
        if shapes and shapes[0] != shapes[2]:
            shape_text = f"{shapes[0]}..{shapes[2]}"
        else:
            shape_text = str(shapes[0] if shapes else info.shape)
        lines.append(f"{info.name}: {info.dtype} {shape_text}")
    return "\n  ".join(lines)


def _feed_problems(info: TensorInfo, feed: Any, shapes: tuple[Shape, Shape, Shape] | None) -> list[str]:
    problems = []
    try:
        dtype = np.dtype(feed.dtype).name
        shape = tuple(int(d) for d in feed.shape)
    except (AttributeError, TypeError):
        return [f"{info.name}: expected a numpy array, got {type(feed).__name__}"]
    if dtype != info.dtype:
        problems.append(f"{info.name}: dtype {dtype}, expected {info.dtype}")
    low, high = (shapes[0], shapes[2]) if shapes else (info.shape, info.shape)
    in_range = len(shape) == len(low) and all(lo <= d <= hi for d, lo, hi in zip(shape, low, high))
    if not in_range:
        problems.append(f"{info.name}: shape {shape} is outside the engine's profile {low}..{high}")
    return problems


def check_feeds(manifest: EngineManifest, feeds: Mapping[str, Any]) -> None:
    """Check names, dtypes and shapes against the engine's profile; one error lists every problem."""
    problems = []
    expected = [info.name for info in manifest.inputs]
    missing = [name for name in expected if name not in feeds]
    unexpected = [name for name in feeds if name not in expected]
    if missing:
        problems.append(f"missing input(s): {missing}")
    if unexpected:
        problems.append(f"unexpected input(s): {unexpected}")
    for info in manifest.inputs:
        if info.name in feeds:
            problems += _feed_problems(info, feeds[info.name], manifest.profile_shapes.get(info.name))
    if problems:
        raise RuntimeInputError(
            f"inputs for engine {manifest.spec_name} do not match it:\n  "
            + "\n  ".join(problems)
            + f"\nexpected:\n  {_expected_inputs(manifest)}"
        )


def numpy_dtype_for(dtype_name: str) -> np.dtype | None:
    """numpy's dtype for a manifest dtype name (bfloat16 through ml_dtypes, which onnx brings);
    None where there is none (fp8, int4, fp4)."""
    if dtype_name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype_name)
    except TypeError:
        return None


def prepare_refit_weights(
    engine_name: str,
    prototypes: Mapping[str, tuple[str, int]],
    weights: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Cast each weight to the dtype the engine was built with and check its size.

    `prototypes` maps a weight name to (dtype name, element count) as TensorRT reports it; a count
    of -1 means the engine has no refittable weight of that name. One RefitError lists every problem.
    """
    prepared: dict[str, np.ndarray] = {}
    problems = []
    for name, array in weights.items():
        dtype_name, count = prototypes.get(name, ("", -1))
        target = numpy_dtype_for(dtype_name) if count >= 0 else None
        if count < 0:
            problems.append(f"{name}: the engine has no refittable weight of this name")
        elif target is None:
            problems.append(f"{name}: the engine holds it as {dtype_name}, which numpy cannot represent")
        elif np.size(array) != count:
            problems.append(f"{name}: {np.size(array)} values (shape {np.shape(array)}), the engine holds {count}")
        else:
            prepared[name] = np.ascontiguousarray(array, dtype=target)
    if problems:
        raise RefitError(f"cannot refit engine {engine_name}:\n  " + "\n  ".join(problems))
    return prepared


def weights_for_refit(
    engine_name: str,
    refitted_before: Iterable[str],
    weights: Mapping[str, np.ndarray],
    base_weights: Mapping[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """The full set of weights one refit must write so that nothing of an earlier refit survives.

    Weights changed by an earlier refit (LoRA A) and absent from this one (LoRA B) go back to their
    base values in the same refit; without base weights that would leave A's residue, so it is refused.
    """
    stale = sorted(set(refitted_before) - set(weights))
    if not stale:
        return dict(weights)
    if base_weights is None:
        raise RefitError(
            f"cannot refit engine {engine_name}: {len(stale)} weight(s) changed by an earlier refit are not in this one "
            f"(e.g. {stale[:5]}); pass the base weights so they are restored, or the earlier LoRA leaves residue"
        )
    absent = [name for name in stale if name not in base_weights]
    if absent:
        raise RefitError(f"cannot refit engine {engine_name}: the base weights lack {absent[:10]}")
    return {**{name: base_weights[name] for name in stale}, **weights}
