"""TensorRT build decisions that need no TensorRT: profiles, flags, manifests, compatibility, paths.

Everything here is pure Python (numpy, onnx, pydantic) so it is tested on CPU machines; the module
that talks to TensorRT (`engine.py`) only carries these decisions out.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError, RefitError, RuntimeInputError
from ...onnx_facts import (  # noqa: F401  (re-exported: the TensorRT build's ONNX facts)
    ProfileShapes,
    Shape,
    TensorInfo,
    check_profile_against_inputs,
    onnx_compute_dtype,
    onnx_has_qdq,
    onnx_input_shapes,
    onnx_sha256,
    read_base_weights,
    validate_profile,
)
from ...workspace.files import atomic_write_bytes  # noqa: F401  (re-exported)

TARGET = "tensorrt"
MANIFEST_SCHEMA_VERSION = 3  # 2: `refit` records what a refit wrote into the plan; 3: `plan_sha256`
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
    # fp8/int8 engines are refittable: a LoRA refit writes the weights and their recomputed weight scales
    # (`engine.refit_quantized_from_base`), the calibrated activation scales stay


@dataclass(frozen=True)
class BuildFlags:
    """The builder settings of one engine, decided from its spec and its ONNX.

    Every engine is strongly typed, on TensorRT 10 and 11 alike (TensorRT 11 has no other mode): the
    ONNX's own dtypes decide the precision of every layer, so no precision flag exists here. An fp16
    engine is built from an fp16 ONNX, a bf16 engine from a bf16 ONNX (both with fp32 I/O), an fp8/int8
    engine from a Q/DQ ONNX over fp16 (see `TENSORRT_ONNX_PRECISION`).
    """

    precision: str
    # fp32 layers may use TF32 math (TensorRT's default); off where fp32 must match a reference to 1e-4
    tf32: bool = True
    strongly_typed: bool = True  # always: recorded so a manifest says how its plan was built
    refit: bool = False
    # STRIP_PLAN: a plan without its weights (a small release artifact); the runner refits them from the ONNX the
    # plan was built from when it loads (`engine.load_engine(weights_onnx=...)`). REFIT_IDENTICAL unless refittable.
    strip_plan: bool = False
    # WEIGHT_STREAMING: weights may stay in host memory and stream in at run time, within a budget the runner sets
    # (`weight_streaming_budget_v2`): FLUX-class models on GPUs smaller than their weights
    weight_streaming: bool = False
    version_compatible: bool = False
    builder_optimization_level: int = 3
    workspace_bytes: int = 8 * GIB

    @classmethod
    def for_spec(cls, spec: EngineSpec, has_qdq: bool) -> BuildFlags:
        if spec.target != TARGET:
            raise BuildError(f"{spec.name}: target is {spec.target!r}, not {TARGET!r}")
        _check_precision(spec, has_qdq)
        return cls(
            precision=spec.precision,
            tf32=bool(spec.option("tensorrt_tf32", True)),
            refit=spec.refittable,
            strip_plan=bool(spec.option("tensorrt_strip_plan", False)),
            weight_streaming=bool(spec.option("tensorrt_weight_streaming", False)),
            version_compatible=bool(spec.option("tensorrt_version_compatible", False)),
            builder_optimization_level=_option_int(spec, "tensorrt_optimization_level", 3, 0, 5),
            workspace_bytes=_option_workspace_bytes(spec),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def builder_flags(self) -> tuple[str, ...]:
        """`tensorrt.BuilderFlag` members to set, by name; the same on TensorRT 10 and 11 (none of them a
        precision flag: those are gone in 11, see tests/targets/test_tensorrt_removed_api.py)."""
        names = []
        if self.refit:
            names.append("REFIT")
        if self.strip_plan:
            names.append("STRIP_PLAN")
            if not self.refit:  # the weights come back from the very ONNX the plan was built from
                names.append("REFIT_IDENTICAL")
        if self.weight_streaming:
            names.append("WEIGHT_STREAMING")
        if self.version_compatible:
            names.append("VERSION_COMPATIBLE")
        return tuple(names)

    def cleared_builder_flags(self) -> tuple[str, ...]:
        """`tensorrt.BuilderFlag` members to clear (TF32 is on by default in a builder config)."""
        return () if self.tf32 else ("TF32",)


def network_creation_flags(trt_version: str) -> tuple[str, ...]:
    """`tensorrt.NetworkDefinitionCreationFlag` members for `create_network`, by name.

    TensorRT 10 builds weakly typed unless STRONGLY_TYPED is set; TensorRT 11 networks are always strongly
    typed and the flag is deprecated there (accepted and ignored), so it is not set.
    """
    return ("STRONGLY_TYPED",) if parse_trt_version(trt_version)[0] < 11 else ()


# The ONNX a tensorrt engine of each precision is built from (strong typing: the graph's dtypes are the
# engine's). fp8/int8: Q/DQ nodes over the family's Q/DQ base graph (`qdq_base_precision`), so the layers left
# unquantized run in fp16 or bf16, not fp32.
TENSORRT_ONNX_PRECISION = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp16", "int8": "fp16"}
ONNX_PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# Families whose denoiser is a transformer (DiT): their activations exceed fp16's range (FLUX, SD3, and their
# T5 encoders), so NVIDIA's demo builds their fp8/int8 engines over bf16. Derived from families.py, so a DiT
# family added there gets bf16 without an edit here.
def _dit_families() -> frozenset[str]:
    from ...families import FAMILIES, Component

    return frozenset(f.value for f, info in FAMILIES.items() if info.denoiser == Component.transformer)


def qdq_base_precision(spec: EngineSpec) -> str:
    """The float precision a spec's engine computes in outside its Q/DQ layers: the spec's own for fp32, fp16
    and bf16; for fp8/int8 the family's Q/DQ base: bf16 for the DiT families, fp16 for the UNet ones."""
    if spec.precision not in QUANTIZED_PRECISIONS:
        return TENSORRT_ONNX_PRECISION.get(spec.precision, spec.precision)
    return "bf16" if spec.family in _dit_families() else "fp16"


def check_onnx_precision(spec: EngineSpec, compute_dtype: str | None) -> None:
    """A strongly typed engine runs in the ONNX's dtypes: refuse an ONNX whose float weights are not the
    dtype the spec's precision needs (an "fp16" engine from an fp32 graph would silently be fp32).
    `compute_dtype` is `onnx_compute_dtype(onnx)`; None (no float weights) passes."""
    base = qdq_base_precision(spec)
    wanted = ONNX_PRECISION_DTYPES[base]
    if compute_dtype is not None and compute_dtype != wanted:
        graph = f"a Q/DQ ONNX over the {base} graph" if spec.precision in QUANTIZED_PRECISIONS else f"an {wanted} ONNX"
        raise BuildError(
            f"{spec.name}: a {spec.precision} TensorRT engine is built strongly typed from {graph}, but this ONNX's "
            f"weights are {compute_dtype}: re-export it (`trt-diffusion export`) so its precision matches the spec"
        )


# ----------------------------------------------------------------------------------------------
# The hardware gate: checked on the CUDA device before TensorRT is started
# ----------------------------------------------------------------------------------------------

# The lowest compute capability whose tensor cores run each precision (TensorRT support matrix):
# BF16 from Ampere (8.0), FP8 from Ada / Hopper (8.9). fp32, fp16 and int8 run on every GPU TensorRT 10/11 supports.
PRECISION_MIN_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {"bf16": (8, 0), "fp8": (8, 9)}


def check_hardware(spec: EngineSpec, compute_capability: tuple[int, int], device_name: str) -> None:
    """BuildError naming the engine, its precision and the GPU when this GPU cannot run the precision."""
    needed = PRECISION_MIN_COMPUTE_CAPABILITY.get(spec.precision)
    if spec.precision in QUANTIZED_PRECISIONS and qdq_base_precision(spec) == "bf16":  # int8 over bf16: Ampere
        needed = max(needed or (0, 0), PRECISION_MIN_COMPUTE_CAPABILITY["bf16"])
    if needed is not None and tuple(compute_capability) < needed:
        raise BuildError(
            f"{spec.name}: precision {spec.precision} needs a GPU of compute capability {needed[0]}.{needed[1]} or "
            f"newer; this host's GPU is {device_name} ({sm_name(compute_capability)}, compute capability "
            f"{compute_capability[0]}.{compute_capability[1]}). Build it on such a GPU or choose another precision"
        )


# TensorRT releases with a known defect in refittable engines, and NVIDIA's words for it (the 11.3 release
# notes' known issues): a gpu test (tests/targets/test_tensorrt_gpu.py) compares a refittable engine with ONNX
# Runtime before a release leaves this list.
REFIT_KNOWN_ISSUES: dict[tuple[int, int], str] = {
    (11, 3): "TensorRT 11.3 can drop the bias of a GEMM in engines built with the REFIT flag (NVIDIA's known issue "
             "in the 11.3 release notes), so a refittable engine may compute wrong results",
}
REFIT_WAIVER_OPTION = "tensorrt_allow_refit_on_11_3"


def check_refit_supported(spec: EngineSpec, trt_version: str) -> None:
    """BuildError for a refittable spec on a TensorRT release with a known refit defect, unless engines.yaml
    waives it (`build.tensorrt.allow_refit_on_11_3: true`)."""
    issue = REFIT_KNOWN_ISSUES.get(parse_trt_version(trt_version)[:2])
    if spec.refittable and issue and not spec.option(REFIT_WAIVER_OPTION, False):
        raise BuildError(
            f"{spec.name}: refittable engines are refused on TensorRT {trt_version}: {issue}. Build on another "
            "TensorRT release, make the model not refittable (LoRAs `mode: fused`), or accept the risk with "
            "`build: {tensorrt: {allow_refit_on_11_3: true}}` in engines.yaml and check the engine with `parity`"
        )


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


def architecture_mismatch(wanted: str, compute_capability: Sequence[int]) -> str | None:
    """Why a plan for GPU architecture `wanted` cannot be built on a GPU of this compute capability."""
    here = sm_name(compute_capability)
    return None if here == wanted else f"engines for {wanted} are built on an {wanted} GPU; this host has {here}"


def sm_name(compute_capability: Sequence[int]) -> str:
    major, minor = compute_capability
    return f"sm_{major}{minor}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


def timing_cache_path(cache_dir: str | Path, compute_capability: tuple[int, int], trt_version: str,
                      device_name: str) -> Path:
    """One timing cache per GPU (compute capability and device name) and full TensorRT version.

    `ITimingCache.combine` skips a cache from any other TensorRT build (it needs the exact version, build
    number included) and `set_timing_cache` rejects one timed on another device, so a cache shared across
    either would be replaced on every build: `sm89-nvidia-l40s-trt10.13.0.35.timing.cache`.
    """
    parse_trt_version(trt_version)  # refuse what is not a version
    cc_major, cc_minor = compute_capability
    return Path(cache_dir) / f"sm{cc_major}{cc_minor}-{_slug(device_name)}-trt{_slug(str(trt_version))}.timing.cache"


_CACHE_LOCKS_GUARD = threading.Lock()
_CACHE_LOCKS: dict[str, threading.Lock] = {}


def _thread_lock_for(path: Path) -> threading.Lock:
    key = os.path.realpath(path)
    with _CACHE_LOCKS_GUARD:
        return _CACHE_LOCKS.setdefault(key, threading.Lock())


@contextlib.contextmanager
def timing_cache_lock(cache_path: str | Path) -> Iterator[None]:
    """Exclusive use of one timing cache file: threads of this process (`build --jobs N` runs threads) and
    other processes alike.

    Polygraphy's LockFile takes `fcntl.lockf`, a POSIX record lock: it belongs to the process, so a second
    thread of the same process "acquires" it at once. `flock` on a file opened per call excludes threads
    on a local Linux file system, but not where flock is emulated with record locks (NFS). So the
    in-process lock is taken first, then `flock` on `<cache>.lock` for other processes.
    """
    path = Path(cache_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _thread_lock_for(path):
        with open(path.with_name(path.name + ".lock"), "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


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
    return datetime.now(UTC).isoformat(timespec="seconds")


class RefitRecord(BaseModel):
    """What `trt-diffusion refit` wrote into a plan saved in place: the plan no longer holds its base weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights_sha256: str  # `weights_digest` of the weights given, by ONNX initializer name
    names: tuple[str, ...]  # the ONNX initializer names that differ from the base ONNX
    # True while a refit is being saved: written before the plan is replaced, so a refit interrupted between
    # the two files leaves a plan that is never taken for its base (the next refit restores it from the ONNX)
    in_progress: bool = False
    # while in progress: the sha256 of the plan being replaced (the file on disk is that one or the new one)
    replacing_sha256: str | None = None
    refitted_at: str = Field(default_factory=lambda: _utc_now())


def weights_digest(weights: Mapping[str, np.ndarray]) -> str:
    """Content hash of refit weights (names, dtypes, shapes, values), independent of their order."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name])
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8).tobytes())
    return digest.hexdigest()


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
    # engine_layout: profiles — the optimization profiles in TensorRT's order (profile_shapes is then their
    # envelope, layout.profile_envelope); None: one profile, profile_shapes
    profiles: tuple[dict[str, tuple[Shape, Shape, Shape]], ...] | None = None
    onnx_sha256: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    refit_map: str | None = None
    # None: the plan holds the weights it was built with (the base). Set by `refit`, cleared by a restore.
    refit: RefitRecord | None = None
    plan_bytes: int
    # sha256 of the plan this manifest describes: checked before TensorRT deserializes it (plan_trust.py);
    # None only in manifests made in code, which nothing loads
    plan_sha256: str | None = None
    # `device_memory_size_v2` of the engine (its activation memory, profile 0): the runner budgets the shared
    # activation allocation with it before loading; None when the build could not read it back
    device_memory_bytes: int | None = None
    # `streamable_weights_size` of an engine built with weight streaming (None otherwise or unread)
    streamable_weights_bytes: int | None = None
    build_seconds: float
    created_at: str = Field(default_factory=_utc_now)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "engine manifest") -> EngineManifest:
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
    def read(cls, path: str | Path) -> EngineManifest:
        path = Path(path)
        if not path.is_file():
            raise BuildError(f"engine manifest {path} is missing: rebuild with `{REBUILD_COMMAND}`")
        return cls.from_json(path.read_text(), source=f"engine manifest {path}")

    @property
    def is_base(self) -> bool:
        """True when the plan holds its base weights; a refitted plan never passes for a built one."""
        return self.refit is None

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
        manifest.is_base  # a LoRA refitted into the plan is not the engine `build` would make
        and manifest.spec_key == spec.key
        and manifest.onnx_sha256 == onnx_digest
        and manifest.flags == flags.to_dict()
        and manifest.profile_shapes == validate_profile(profile_shapes)
        and parse_trt_version(manifest.tensorrt_version) == parse_trt_version(trt_version)
        and tuple(manifest.compute_capability) == tuple(compute_capability)
    )


# ----------------------------------------------------------------------------------------------
# Compatibility between an engine and the host that loads it
# ----------------------------------------------------------------------------------------------


def versions_compatible(built: str, runtime: str, version_compatible: bool) -> bool:
    """May a plan built with TensorRT `built` be deserialized by TensorRT `runtime`?

    Without VERSION_COMPATIBLE: only by the exact version it was built with (major.minor.patch). With it:
    by the same or a newer runtime of the same major, and across one major boundary the support matrix
    names: TensorRT 10 version-compatible engines run on a TensorRT 11 runtime. Never by an older runtime.
    """
    built_version, runtime_version = parse_trt_version(built), parse_trt_version(runtime)
    if not version_compatible:
        return built_version == runtime_version
    if runtime_version < built_version:
        return False
    return runtime_version[0] == built_version[0] or (built_version[0], runtime_version[0]) in CROSS_MAJOR_COMPATIBLE


# (built major, runtime major) pairs the TensorRT support matrix allows for version-compatible engines
CROSS_MAJOR_COMPATIBLE = frozenset({(10, 11)})


def check_engine_compatible(
    manifest: EngineManifest,
    runtime_trt_version: str,
    runtime_compute_capability: tuple[int, int],
    runtime_device_name: str | None = None,
) -> None:
    """Refuse an engine built for another TensorRT version or GPU architecture, before TensorRT
    fails to deserialize it with a message that names neither."""
    version_compatible = bool(manifest.flags.get("version_compatible", False))
    version_ok = versions_compatible(manifest.tensorrt_version, runtime_trt_version, version_compatible)
    cc_ok = tuple(manifest.compute_capability) == tuple(runtime_compute_capability)
    if version_ok and cc_ok:
        return
    built = f"TensorRT {manifest.tensorrt_version} for {sm_name(manifest.compute_capability)} ({manifest.device_name})"
    host_device = f" ({runtime_device_name})" if runtime_device_name else ""
    host = f"TensorRT {runtime_trt_version} and {sm_name(runtime_compute_capability)}{host_device}"
    rules = []
    if not version_ok:
        rules.append(
            "a version-compatible engine loads only on the TensorRT version it was built with or a newer one of the "
            "same major (a TensorRT 10 one also on TensorRT 11)"
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
    if not problems and manifest.profiles:  # inside the envelope, but inside one of the profiles?
        from .layout import select_profile

        shapes = {name: tuple(int(d) for d in feeds[name].shape) for name in expected}
        if select_profile(manifest.profiles, shapes) is None:
            listed = "; ".join(f"profile {i}: " + ", ".join(f"{n} {lo}..{hi}" for n, (lo, _, hi) in prof.items())
                               for i, prof in enumerate(manifest.profiles))
            problems.append(f"shapes {shapes} fit none of the engine's {len(manifest.profiles)} profiles ({listed})")
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
