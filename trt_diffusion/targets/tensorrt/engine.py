"""The TensorRT target: build, load, run and refit one engine per EngineSpec.

The only module of trt-diffusion that imports `tensorrt`, and only inside functions: importing this
module needs neither TensorRT nor a GPU, and `tensorrt_available()` says why a host cannot build.
Every decision (flags, profile checks, manifests, compatibility, the hardware gate) lives in the pure modules
beside it (build_flags, precision, host_gates, manifest, feeds, refit_weights, ...); this module carries them
out through TensorRT's own API (Builder, OnnxParser, Runtime, Refitter, OnnxParserRefitter), typed against the
TensorRT stubs: tests/targets/test_tensorrt_typecheck.py runs mypy over it, so a misspelled or removed
TensorRT name fails the default test suite.

Builds are strongly typed on TensorRT 10 and 11: precision comes from the ONNX (see build_flags.BuildFlags).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError, MissingDependencyError, RefitError
from ...onnx_facts import (
    ProfileShapes,
    check_profile_against_inputs,
    onnx_compute_dtype,
    onnx_has_qdq,
    onnx_input_shapes,
    onnx_sha256,
    validate_profile,
)
from ...tensors import TensorSpec
from ...workspace.files import atomic_write_bytes
from .build_flags import BuildFlags, network_creation_flags
from .dtypes import TRT_DTYPE_NAMES
from .feeds import check_feeds
from .host_gates import check_engine_compatible, check_hardware, check_refit_supported
from .layout import profile_envelope
from .manifest import REBUILD_COMMAND, EngineManifest, manifest_path
from .plan_stream import (
    STREAM_THRESHOLD_BYTES,
    load_mode,
    open_verified,
    privately_writable,
    stream_reader,
)
from .plan_trust import check_plan_bytes, host_code_allowed, interrupted_refit_problem, plan_sha256
from .served_memory import onnx_weight_bytes
from .precision import check_onnx_precision
from .refit_weights import prepare_refit_weights, weights_for_refit
from .timing_cache import timing_cache_lock, timing_cache_path
from .versions import sm_name

if TYPE_CHECKING:  # the annotations below are TensorRT's own types (tensorrt-stubs in the test extra)
    import tensorrt as trt

LOG = logging.getLogger(__name__)

INSTALL_HINT = (
    "the tensorrt target needs TensorRT 10 and an NVIDIA GPU: "
    "pip install 'trt-diffusion[tensorrt]' --extra-index-url https://pypi.nvidia.com"
)

REFIT_THREADS = max(1, min(8, (os.cpu_count() or 1)))
HostInfo = tuple[str, tuple[int, int], str]  # (TensorRT version, compute capability, device name)


# ----------------------------------------------------------------------------------------------
# What this host has
# ----------------------------------------------------------------------------------------------


def _import_tensorrt() -> tuple[ModuleType | None, str]:
    """(the tensorrt module, "") or (None, why it cannot be used)."""
    try:
        import tensorrt as trt
    except Exception as err:  # ImportError, or OSError when its shared libraries are missing
        return None, f"the tensorrt module cannot be imported ({type(err).__name__}: {err})"
    if not hasattr(trt, "Builder"):
        # a namespace package left by type stubs, or NVIDIA's placeholder package without the libraries
        return None, "the installed 'tensorrt' package has no TensorRT libraries (a stub or placeholder package)"
    return trt, ""


def _require_tensorrt() -> ModuleType:
    trt, reason = _import_tensorrt()
    if trt is None:
        raise MissingDependencyError(f"{reason}; {INSTALL_HINT}")
    return trt


@dataclass(frozen=True)
class CudaDevice:
    compute_capability: tuple[int, int]
    name: str


def _device_from_cuda_python(index: int = 0) -> CudaDevice | str:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6 layout
        except ImportError as err:
            return f"cuda-python is not installed ({err})"
    success = cudart.cudaError_t.cudaSuccess
    status, count = cudart.cudaGetDeviceCount()
    if status != success:
        return f"the CUDA runtime reports {status.name}"
    if count <= index:
        return f"the CUDA runtime sees {count} device(s), no device {index}"
    status, props = cudart.cudaGetDeviceProperties(index)
    if status != success:
        return f"cudaGetDeviceProperties failed with {status.name}"
    name = props.name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    return CudaDevice((int(props.major), int(props.minor)), name)


def _device_from_torch(index: int = 0) -> CudaDevice | str:
    try:
        import torch
    except ImportError as err:
        return f"torch is not installed ({err})"
    if not torch.cuda.is_available():
        return f"torch sees no CUDA device (its build: CUDA {torch.version.cuda or 'none'})"
    if torch.cuda.device_count() <= index:
        return f"torch sees {torch.cuda.device_count()} CUDA device(s), no device {index}"
    major, minor = torch.cuda.get_device_capability(index)
    return CudaDevice((int(major), int(minor)), torch.cuda.get_device_name(index))


@functools.lru_cache(maxsize=16)
def _probe_cuda_device(index: int = 0) -> tuple[CudaDevice | None, tuple[str, ...]]:
    """Device `index` as the CUDA runtime numbers it (honours CUDA_VISIBLE_DEVICES); cuda-python first,
    torch as the fallback. Cached: the GPUs do not change within a process."""
    reasons = []
    for probe in (_device_from_cuda_python, _device_from_torch):
        try:
            found = probe(index)
        except Exception as err:  # noqa: BLE001 - a broken CUDA install is a reason, not a crash
            found = f"{probe.__name__}: {type(err).__name__}: {err}"
        if isinstance(found, CudaDevice):
            return found, ()
        reasons.append(found)
    return None, tuple(reasons)


def tensorrt_available() -> tuple[bool, str]:
    """(True, a description of TensorRT and the GPU) or (False, why this host cannot use the target)."""
    trt, reason = _import_tensorrt()
    if trt is None:
        return False, reason
    device, reasons = _probe_cuda_device()
    if device is None:
        return False, "no CUDA device: " + "; ".join(reasons)
    return True, f"TensorRT {trt.__version__} on {device.name} ({sm_name(device.compute_capability)})"


def host_info(device_index: int = 0) -> HostInfo:
    """(TensorRT version, compute capability, name) of GPU `device_index`; MissingDependencyError otherwise."""
    trt = _require_tensorrt()
    device, reasons = _probe_cuda_device(device_index)
    if device is None:
        raise MissingDependencyError("no CUDA device: " + "; ".join(reasons) + f"; {INSTALL_HINT}")
    return str(trt.__version__), device.compute_capability, device.name


# ----------------------------------------------------------------------------------------------
# TensorRT's log: forwarded to `logging`, recent errors kept for our error messages
# ----------------------------------------------------------------------------------------------


class _ErrorLog:
    """The last TensorRT errors, numbered, so one operation can quote the errors it caused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._errors: deque[tuple[int, str]] = deque(maxlen=50)

    def add(self, message: str) -> None:
        with self._lock:
            self._errors.append((self._count, message))
            self._count += 1

    def mark(self) -> int:
        with self._lock:
            return self._count

    def since(self, mark: int) -> list[str]:
        with self._lock:
            return [message for index, message in self._errors if index >= mark]


_ERRORS = _ErrorLog()
_LOGGER_LOCK = threading.Lock()
_LOGGER: trt.ILogger | None = None


def _make_logger() -> trt.ILogger:
    import tensorrt as trt

    severity = trt.ILogger.Severity
    levels = {
        severity.INTERNAL_ERROR: logging.CRITICAL,
        severity.ERROR: logging.ERROR,
        severity.WARNING: logging.WARNING,
        severity.INFO: logging.INFO,
        severity.VERBOSE: logging.DEBUG,
    }
    errors = (severity.INTERNAL_ERROR, severity.ERROR)

    class RecordingLogger(trt.ILogger):
        """TensorRT calls this from its own threads: it must be thread-safe and must not raise."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            try:
                if severity in errors:
                    _ERRORS.add(msg)
                python_level = levels.get(severity, logging.DEBUG)
                if LOG.isEnabledFor(python_level):
                    LOG.log(python_level, "TensorRT: %s", msg)
            except Exception:  # noqa: BLE001 - an exception must not cross into TensorRT
                pass

    return RecordingLogger()


def _trt_logger() -> trt.ILogger:
    """One logger for the process: TensorRT treats the first logger it is given as the global one."""
    import tensorrt as trt

    global _LOGGER
    with _LOGGER_LOCK:
        if _LOGGER is None:
            _LOGGER = _make_logger()
            trt.init_libnvinfer_plugins(_LOGGER, "")
        return _LOGGER


def _with_trt_errors(message: str, mark: int) -> str:
    said = _ERRORS.since(mark)
    return message + ("\nTensorRT said:\n  " + "\n  ".join(said) if said else "")


# ----------------------------------------------------------------------------------------------
# Build: strongly typed on TensorRT 10 and 11, straight through TensorRT's builder API
# ----------------------------------------------------------------------------------------------


def _builder_flag(name: str) -> trt.BuilderFlag:
    """The BuilderFlag members `BuildFlags` may name: none of them a precision flag (gone in TensorRT 11)."""
    import tensorrt as trt

    return {
        "REFIT": trt.BuilderFlag.REFIT,
        "REFIT_IDENTICAL": trt.BuilderFlag.REFIT_IDENTICAL,
        "STRIP_PLAN": trt.BuilderFlag.STRIP_PLAN,
        "WEIGHT_STREAMING": trt.BuilderFlag.WEIGHT_STREAMING,
        "VERSION_COMPATIBLE": trt.BuilderFlag.VERSION_COMPATIBLE,
        "TF32": trt.BuilderFlag.TF32,
    }[name]


def _network_flags(trt_version: str) -> int:
    import tensorrt as trt

    known = {"STRONGLY_TYPED": trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED}
    bits = 0
    for name in network_creation_flags(trt_version):
        bits |= 1 << int(known[name])
    return bits


def _parser_error_text(error: trt.ParserError) -> str:
    try:
        node = f" (node {error.node_name() or error.node()}, {error.node_operator()})" if error.node() >= 0 else ""
        return f"{error.desc()}{node}"
    except Exception:  # noqa: BLE001 - older bindings lack some accessors; str() always works
        return str(error)


def _parse_onnx(onnx_path: Path, trt_version: str,
                spec_name: str) -> tuple[trt.Builder, trt.INetworkDefinition, trt.OnnxParser]:
    """(builder, network, parser); a BuildError carries the parser's own words."""
    import tensorrt as trt

    logger = _trt_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt_version))
    parser = trt.OnnxParser(network, logger)
    parsed = parser.parse_from_file(str(onnx_path))  # from a path, so external data is found beside it
    errors = [_parser_error_text(parser.get_error(i)) for i in range(parser.num_errors)]
    if not parsed or errors:
        detail = "\n  ".join(errors) or "the parser gave no reason"
        raise BuildError(f"{spec_name}: TensorRT could not parse {onnx_path}:\n  {detail}")
    return builder, network, parser


def _create_config(builder: trt.Builder, flags: BuildFlags, profiles: Sequence[ProfileShapes], cache_path: Path,
                   spec_name: str) -> trt.IBuilderConfig:
    """The builder config: flags, workspace, and one optimization profile per entry of `profiles` (one for a
    per-shape engine; one per bucket × batch shape for `engine_layout: profiles`, in the manifest's order)."""
    import tensorrt as trt

    mark = _ERRORS.mark()
    config = builder.create_builder_config()
    for name in flags.builder_flags():
        config.set_flag(_builder_flag(name))
    for name in flags.cleared_builder_flags():
        config.clear_flag(_builder_flag(name))
    config.builder_optimization_level = flags.builder_optimization_level
    if flags.workspace_bytes is not None:  # only an explicit workspace_gb caps the tactics' scratch memory
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, flags.workspace_bytes)
    for index, shapes in enumerate(profiles):
        profile = builder.create_optimization_profile()
        for name, (min_shape, opt_shape, max_shape) in shapes.items():
            profile.set_shape(name, trt.Dims(list(min_shape)), trt.Dims(list(opt_shape)), trt.Dims(list(max_shape)))
        if config.add_optimization_profile(profile) != index:
            raise BuildError(_with_trt_errors(
                f"{spec_name}: TensorRT rejected optimization profile {index} {dict(shapes)}", mark))
    # the file is replaced atomically under the cache lock, so reading it needs no lock
    cached = cache_path.read_bytes() if cache_path.is_file() else b""
    cache = config.create_timing_cache(cached)
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        LOG.warning("timing cache %s does not fit this TensorRT and GPU; building without it", cache_path)
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    return config


def _build_plan(builder: trt.Builder, network: trt.INetworkDefinition, config: trt.IBuilderConfig,
                spec_name: str) -> trt.IHostMemory:
    mark = _ERRORS.mark()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(_with_trt_errors(f"{spec_name}: TensorRT could not build the engine", mark))
    return plan


def _save_timing_cache(config: trt.IBuilderConfig, cache_path: Path) -> None:
    """Merge this build's timings into the shared cache file, under `timing_cache_lock` (parallel builds
    in threads and processes share it) and through a temporary file, so a reader never sees half of it."""
    cache = config.get_timing_cache()
    if cache is None:
        return
    with timing_cache_lock(cache_path):
        if cache_path.is_file():  # timings another build added since this one started
            on_disk = config.create_timing_cache(cache_path.read_bytes())
            if not cache.combine(on_disk, ignore_mismatch=False):
                LOG.warning("timing cache %s was written by another TensorRT build or GPU; replacing it", cache_path)
        atomic_write_bytes(cache_path, cache.serialize())


def _dtype_name(trt_dtype: trt.DataType) -> str:
    return TRT_DTYPE_NAMES.get(trt_dtype.name, trt_dtype.name.lower())


def _tensor_specs(tensors: Iterable[trt.ITensor]) -> tuple[TensorSpec, ...]:
    def shape(dims: trt.Dims) -> tuple[int, ...]:
        return tuple(dims[i] for i in range(len(dims)))

    return tuple(TensorSpec(name=t.name, dtype=_dtype_name(t.dtype), shape=shape(t.shape)) for t in tensors)


def check_can_build(spec: EngineSpec) -> CudaDevice:
    """The hardware gate, before TensorRT is started: BuildError naming the engine, its precision and the
    GPU when this GPU cannot run the precision (BF16 needs compute capability 8.0, FP8 8.9)."""
    device, reasons = _probe_cuda_device()
    if device is None:
        raise MissingDependencyError("no CUDA device: " + "; ".join(reasons) + f"; {INSTALL_HINT}")
    check_hardware(spec, device.compute_capability, device.name)
    return device


def build_engine(
    onnx_path: str | Path,
    spec: EngineSpec,
    profile_shapes: ProfileShapes,
    out_path: str | Path,
    timing_cache_dir: str | Path,
    refit_map: str | Path | None = None,
    extra_profiles: Sequence[ProfileShapes] = (),
    profile_labels: Sequence[str] | None = None,
) -> EngineManifest:
    """Build one strongly typed engine: the plan at `out_path`, its manifest beside it, the timing cache updated.

    `extra_profiles` (engine_layout: profiles): more optimization profiles after `profile_shapes`, one engine
    holding the weights once for every bucket × batch shape; the manifest records them all (and `profile_labels`,
    what each is for).

    Everything that can be checked without TensorRT (profile, ONNX inputs, precision vs Q/DQ and vs the
    ONNX's dtypes, the GPU's compute capability) is checked first, so a wrong request fails the same way
    on a CPU host and never starts a TensorRT builder.
    """
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    profiles = [validate_profile(shapes) for shapes in (profile_shapes, *extra_profiles)]
    for shapes in profiles:
        check_profile_against_inputs(shapes, onnx_input_shapes(onnx_path))
    shapes = profile_envelope(profiles) if len(profiles) > 1 else profiles[0]
    flags = BuildFlags.for_spec(spec, onnx_has_qdq(onnx_path))
    check_onnx_precision(spec, onnx_compute_dtype(onnx_path))
    check_can_build(spec)
    _require_tensorrt()
    trt_version, compute_capability, device_name = host_info()
    check_refit_supported(spec, trt_version)  # before TensorRT builds anything
    digest = onnx_sha256(onnx_path)
    cache_path = timing_cache_path(timing_cache_dir, compute_capability, trt_version, device_name)

    started = time.perf_counter()
    builder, network, _parser = _parse_onnx(onnx_path, trt_version, spec.name)
    config = _create_config(builder, flags, profiles, cache_path, spec.name)
    plan = _build_plan(builder, network, config, spec.name)
    build_seconds = time.perf_counter() - started

    manifest_file = manifest_path(out_path)
    manifest_file.unlink(missing_ok=True)  # a stale manifest must never describe the new plan
    atomic_write_bytes(out_path, plan)
    try:
        _save_timing_cache(config, cache_path)
    except OSError as err:  # the engine is good; a cache is only a speed-up
        LOG.warning("could not update timing cache %s: %s", cache_path, err)

    sizes = _engine_sizes(plan, flags.version_compatible, spec.name, len(profiles),
                          onnx_weight_bytes(onnx_path) if flags.strip_plan else None)
    manifest = EngineManifest(
        spec_key=spec.key,
        spec_name=spec.name,
        tensorrt_version=trt_version,
        compute_capability=compute_capability,
        device_name=device_name,
        flags=flags.to_dict(),
        profile_shapes=shapes,
        profiles=tuple(profiles) if len(profiles) > 1 else None,
        profile_labels=tuple(profile_labels) if profile_labels and len(profiles) > 1 else None,
        onnx_sha256=digest,
        onnx_path=str(onnx_path.resolve()),
        inputs=_tensor_specs(network.get_input(i) for i in range(network.num_inputs)),
        outputs=_tensor_specs(network.get_output(i) for i in range(network.num_outputs)),
        refit_map=str(refit_map) if refit_map is not None else None,
        plan_bytes=plan.nbytes,
        plan_sha256=plan_sha256(plan),
        device_memory_bytes=sizes.activation_bytes,
        profile_device_memory_bytes=sizes.profile_activation_bytes,
        weights_bytes=sizes.weights_bytes,
        streamable_weights_bytes=sizes.streamable_bytes if flags.weight_streaming else None,
        build_seconds=round(build_seconds, 3),
    )
    manifest.write(manifest_file)
    LOG.info("built %s in %.1f s (%s)", spec.name, build_seconds, out_path)
    return manifest


@dataclass(frozen=True)
class EngineSizes:
    """What a runner and `package` budget before loading a plan, read back once at build time (the builder
    reports none of them)."""

    activation_bytes: int | None = None  # device_memory_size_v2: the largest over the profiles
    streamable_bytes: int | None = None  # streamable_weights_size
    profile_activation_bytes: tuple[int, ...] | None = None  # get_device_memory_size_for_profile_v2, per profile
    weights_bytes: int | None = None  # the weights the engine holds once loaded (and refitted, when stripped)


def total_weights_bytes(engine: trt.ICudaEngine) -> int | None:
    """`get_engine_stat(EngineStat.TOTAL_WEIGHTS_SIZE)` where this TensorRT has it (11.x; not in 10.13, whose stubs
    the type check reads: hence the guarded getattr); None otherwise."""
    import tensorrt as trt

    stat = getattr(getattr(trt, "EngineStat", None), "TOTAL_WEIGHTS_SIZE", None)
    getter = getattr(engine, "get_engine_stat", None)
    if stat is None or getter is None:
        return None
    try:
        return int(getter(stat))
    except Exception:  # noqa: BLE001 - a figure for budgeting only
        return None


def _engine_sizes(plan: trt.IHostMemory, version_compatible: bool, spec_name: str, profiles: int = 1,
                  onnx_weights: int | None = None) -> EngineSizes:
    """The sizes of the plan just built (our own plan: its host code, if version-compatible, may run). Weights:
    TensorRT's own count where it has one, else `onnx_weights` (the ONNX's weight bytes: what a stripped plan
    holds once refitted, which its file size is not). Empty, with a warning, when they cannot be read."""
    import tensorrt as trt

    try:
        runtime = trt.Runtime(_trt_logger())
        runtime.engine_host_code_allowed = version_compatible
        engine = runtime.deserialize_cuda_engine(plan)
        if engine is None:
            return EngineSizes(weights_bytes=onnx_weights)
        per_profile = tuple(int(engine.get_device_memory_size_for_profile_v2(i)) for i in range(profiles))
        weights = total_weights_bytes(engine)
        return EngineSizes(int(engine.device_memory_size_v2), int(engine.streamable_weights_size),
                           per_profile if profiles > 1 else None, weights if weights is not None else onnx_weights)
    except Exception as err:  # noqa: BLE001 - the plan is good; the figures are only for budgeting
        LOG.warning("%s: could not read the engine's memory sizes back (%s)", spec_name, err)
        return EngineSizes(weights_bytes=onnx_weights)


# ----------------------------------------------------------------------------------------------
# Load and run
# ----------------------------------------------------------------------------------------------


@dataclass
class TensorRTEngine:
    """A deserialized engine with its manifest; `refitted_names` are the weights that differ from the
    base ONNX's: those a refit saved into the plan (from its manifest, so a restore on load covers them)
    and those refitted in this process since. `device_refitter`: the Refitter of its device-resident hot swaps."""

    plan_path: Path
    manifest: EngineManifest
    engine: trt.ICudaEngine
    refitted_names: set[str] = field(default_factory=set)
    device_refitter: trt.Refitter | None = None


def _check_plan_file(plan_path: Path, manifest: EngineManifest, for_refit: bool) -> None:
    """Missing or resized: refused before the (multi-GB) read; the digest is checked on the bytes read."""
    if not plan_path.is_file():
        raise BuildError(f"engine plan {plan_path} is missing: rebuild with `{REBUILD_COMMAND}`")
    size = plan_path.stat().st_size
    if size != manifest.plan_bytes and not (for_refit and manifest.refit is not None and manifest.refit.in_progress):
        raise BuildError(
            f"engine plan {plan_path} has {size} bytes, its manifest says {manifest.plan_bytes} "
            f"(an interrupted copy?): rebuild with `{REBUILD_COMMAND}`"
        )


def _deserialize(plan: bytes, manifest: EngineManifest, allow_host_code: bool) -> trt.ICudaEngine:
    import tensorrt as trt

    mark = _ERRORS.mark()
    runtime = trt.Runtime(_trt_logger())
    if allow_host_code:
        # a version-compatible plan carries its lean runtime (host code): only for a plan whose bytes matched
        # its manifest's sha256 and whose spec asks for it (plan_trust.host_code_allowed)
        runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise BuildError(_with_trt_errors(
            f"engine {manifest.spec_name} could not be deserialized: rebuild with `{REBUILD_COMMAND}`", mark))
    return engine


def load_engine(plan_path: str | Path, host: HostInfo | None = None, *, spec: EngineSpec | None = None,
                for_refit: bool = False, stream: bool | None = None,
                weights_onnx: str | Path | None = None, device: int = 0) -> TensorRTEngine:
    """Read the manifest, refuse a plan built for another TensorRT or GPU, a plan whose bytes are not the ones
    its manifest's sha256 names, and one whose refit was interrupted; then deserialize.

    `host` is (TensorRT version, compute capability, device name) when the caller already knows it; by default
    it is probed. `spec`, when known, must ask for `tensorrt_version_compatible` before a version-compatible plan
    may run its host code. `for_refit`: `refit` may load a plan whose refit was interrupted (it restores every
    weight from the ONNX), and nothing else may. `stream`: through an IStreamReaderV2 in chunks (plan_stream.py;
    None: for plans of 1 GiB and more). A stripped plan (STRIP_PLAN) gets its weights from `weights_onnx`, the ONNX
    it was built from (its sha256 checked against the manifest), before anything runs it.
    """
    plan_path = Path(plan_path)
    manifest = EngineManifest.read(manifest_path(plan_path))
    stripped = manifest.stripped  # a stripped build refitted with a LoRA was saved with its weights
    if stripped and weights_onnx is None and not for_refit:  # `refit` restores every weight from the ONNX itself
        raise BuildError(f"engine plan {plan_path} is a stripped plan (STRIP_PLAN): load it with the ONNX it was "
                         "built from (weights_onnx), whose weights are refitted into it")
    if stripped and weights_onnx is not None:
        from .target import check_refit_base

        check_refit_base(manifest, Path(weights_onnx))  # before anything is deserialized
    if spec is not None and manifest.spec_key != spec.key:
        raise BuildError(f"engine plan {plan_path} was built for spec {manifest.spec_key}, not {spec.key} "
                         f"({spec.name}): rebuild with `{REBUILD_COMMAND}`")
    trt_version, compute_capability, device_name = host if host is not None else host_info(device)
    check_engine_compatible(manifest, trt_version, compute_capability, device_name)
    if not for_refit and (problem := interrupted_refit_problem(manifest)):
        raise BuildError(problem)
    _check_plan_file(plan_path, manifest, for_refit)
    trt_mod = _require_tensorrt()
    wants_host_code = host_code_allowed(manifest, manifest.plan_sha256, spec)  # if the bytes verify
    mode = "memory" if stream is False else load_mode(
        manifest.plan_bytes, wants_host_code, privately_writable(plan_path),
        threshold=0 if stream else STREAM_THRESHOLD_BYTES)
    if mode == "stream":
        engine = _deserialize_streamed(trt_mod, plan_path, manifest, wants_host_code, for_refit)
    else:
        plan = plan_path.read_bytes()
        digest = check_plan_bytes(manifest, plan, f"engine plan {plan_path}", for_refit=for_refit)
        engine = _deserialize(plan, manifest, host_code_allowed(manifest, digest, spec))
        del plan
    refitted = set(manifest.refit.names) if manifest.refit is not None else set()
    loaded = TensorRTEngine(plan_path=plan_path, manifest=manifest, engine=engine, refitted_names=refitted)
    if stripped and weights_onnx is not None:
        refit_from_base(loaded, weights_onnx)  # every stripped weight, from the ONNX the plan was built from
    return loaded


def _deserialize_streamed(trt_mod: ModuleType, plan_path: Path, manifest: EngineManifest, host_code: bool,
                          for_refit: bool) -> trt.ICudaEngine:
    """Verify through one open handle, then let TensorRT pull the plan from it in chunks, in any order it reads and
    seeks; an engine given a chunk that differed on the second read is dropped."""
    mark = _ERRORS.mark()
    verified = open_verified(plan_path, manifest, for_refit=for_refit)
    with verified.handle:
        source = verified.source()
        runtime = trt_mod.Runtime(_trt_logger())
        if host_code:
            runtime.engine_host_code_allowed = True
        engine = runtime.deserialize_cuda_engine(stream_reader(source))
        if engine is not None and not source.verdict():
            del engine
            raise BuildError(f"engine plan {plan_path} changed while it was being loaded: rebuild or reload it")
    if engine is None:
        raise BuildError(_with_trt_errors(
            f"engine {manifest.spec_name} could not be deserialized: rebuild with `{REBUILD_COMMAND}`", mark))
    return engine


def run_engine(engine: TensorRTEngine | str | Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One inference. Inputs are checked against the manifest's names, dtypes and profile first,
    so a wrong feed fails with the expected shapes listed, not with a TensorRT binding error."""
    if isinstance(engine, (str, Path)):
        check_feeds(EngineManifest.read(manifest_path(engine)), feeds)
        engine = load_engine(engine)
    else:
        check_feeds(engine.manifest, feeds)
    from polygraphy.backend.trt import TrtRunner

    contiguous = {name: np.ascontiguousarray(array) for name, array in feeds.items()}
    with TrtRunner(engine.engine) as runner:
        outputs = runner.infer(feed_dict=contiguous)
    # the runner reuses its host buffers on the next call: hand out copies
    return {name: np.array(array, copy=True) for name, array in outputs.items()}


# ----------------------------------------------------------------------------------------------
# Refit
# ----------------------------------------------------------------------------------------------


def _refitter(engine: TensorRTEngine, *, base_only: bool = False) -> trt.Refitter:
    """A Refitter over the engine. A stripped plan built without REFIT is REFIT_IDENTICAL: TensorRT may refit it
    only with the very weights it was built from (`base_only`: restoring them from its ONNX); anything else is
    undefined behaviour there (NvInferRuntime.h, kREFIT_IDENTICAL), so a LoRA is refused."""
    flags = engine.manifest.flags
    if not flags.get("refit"):
        if not flags.get("strip_plan"):
            raise RefitError(f"engine {engine.manifest.spec_name} was not built refittable (refittable: false in its "
                             "spec)")
        if not base_only:
            raise RefitError(
                f"engine {engine.manifest.spec_name} is a stripped plan built REFIT_IDENTICAL (strip_plan without "
                "refittable): TensorRT refits it only with the weights it was built from, never a LoRA; mark the "
                "component refittable (REFIT) to refit other weights")
    _require_tensorrt()
    import tensorrt as trt

    refitter = trt.Refitter(engine.engine, _trt_logger())
    refitter.max_threads = REFIT_THREADS  # weights validated and copied in parallel (hot swap on a serving host)
    return refitter


def refittable_weight_names(engine: TensorRTEngine) -> list[str]:
    """Names (ONNX initializer names) of every weight the engine can refit."""
    return sorted(name for name in _refitter(engine).get_all_weights() if name)


def _prototypes(refitter: trt.Refitter, names: Iterable[str]) -> dict[str, tuple[str, int]]:
    prototypes = {}
    for name in names:
        prototype = refitter.get_weights_prototype(name)
        prototypes[name] = (_dtype_name(prototype.dtype), int(prototype.size))
    return prototypes


def _as_trt_weights(refitter: trt.Refitter, name: str, array: np.ndarray) -> trt.Weights:
    # by pointer, typed as the engine's own weights: no numpy-to-TensorRT dtype mapping (bfloat16 has
    # none); `array` must stay alive until refit_cuda_engine returns, as Weights do not copy
    import tensorrt as trt

    return trt.Weights(refitter.get_weights_prototype(name).dtype, array.ctypes.data, array.size)


def _set_named_weights(refitter: trt.Refitter, prepared: Mapping[str, np.ndarray], engine_name: str) -> None:
    rejected = [
        name for name, array in prepared.items()
        if not refitter.set_named_weights(name, _as_trt_weights(refitter, name, array))
    ]
    if rejected:
        raise RefitError(f"TensorRT rejected weight(s) {rejected} for engine {engine_name}")


def _refit_cuda_engine(engine: TensorRTEngine, refitter: trt.Refitter, written: Iterable[str],
                       stream_handle: int | None = None) -> None:
    """`refit_cuda_engine`, or with `stream_handle` `refit_cuda_engine_async` on the stream every run of the
    engine is queued on (a serving runner's: ordered after the runs already queued, no host sync)."""
    name = engine.manifest.spec_name
    missing = sorted(n or "<unnamed>" for n in refitter.get_missing_weights())
    if missing:
        raise RefitError(
            f"cannot refit engine {name}: TensorRT also needs weight(s) {missing} "
            "(fused with the ones given); pass base_weights or include them"
        )
    mark = _ERRORS.mark()
    done = refitter.refit_cuda_engine() if stream_handle is None else refitter.refit_cuda_engine_async(stream_handle)
    if not done:
        # TensorRT may have written some of them: count all as changed so a restore covers them
        engine.refitted_names |= set(written)
        raise RefitError(_with_trt_errors(f"TensorRT failed to refit engine {name}", mark))


@dataclass(frozen=True)
class DeviceWeights:
    """Refit weights held in GPU memory (uploaded once, cast to the engine's dtype): `count` elements at `pointer`."""

    pointer: int
    count: int
    nbytes: int


def _device_refitter(engine: TensorRTEngine) -> trt.Refitter:
    """One Refitter per loaded engine for its device-resident hot swaps (not one per swap): every weight name it
    was ever given points at memory still held (a resident set or a base copy: each swap re-sets every name the
    last one changed)."""
    if engine.device_refitter is None:
        refitter = _refitter(engine)
        # the runner checked every value finite when it uploaded it (refit_weights.check_finite_weights):
        # TensorRT's own validation would read the device weights again on every swap
        refitter.weights_validation = False
        engine.device_refitter = refitter
    return engine.device_refitter


def refit_prototypes(engine: TensorRTEngine, names: Iterable[str]) -> dict[str, tuple[str, int]]:
    """(dtype name, element count) of each named weight as the engine holds it (count -1: no such weight)."""
    return _prototypes(_device_refitter(engine), names)


def serialize_refitted(engine: TensorRTEngine, *, with_weights: bool) -> trt.IHostMemory:
    """The plan of a refitted engine. A plan built with STRIP_PLAN keeps EXCLUDE_WEIGHTS in its default
    serialization config (NvInferRuntime.h, SerializationFlag): `serialize()` would save it stripped again, and
    its load would refit the base weights from the ONNX over the LoRA. `with_weights` (a LoRA was refitted):
    the weights are saved in the plan (EXCLUDE_WEIGHTS cleared, as TensorRT-LLM and demo/Diffusion do); the
    manifest's refit record then says the plan holds them (`EngineManifest.stripped` is False)."""
    import tensorrt as trt

    config = engine.engine.create_serialization_config()
    if with_weights:
        config.clear_flag(trt.SerializationFlag.EXCLUDE_WEIGHTS)
    mark = _ERRORS.mark()
    plan = engine.engine.serialize_with_config(config)
    if plan is None:
        raise RefitError(_with_trt_errors(f"TensorRT could not serialize the refitted engine "
                                          f"{engine.manifest.spec_name}", mark))
    return plan


def refit_engine_on_device(
    engine: TensorRTEngine,
    weights: Mapping[str, DeviceWeights],
    stream_handle: int,
    changed: Iterable[str],
    fill: Callable[[list[str]], Mapping[str, DeviceWeights]] | None = None,
) -> None:
    """LoRA hot swap from device-resident weights: each weight given by its device pointer
    (`set_named_weights(..., TensorLocation.DEVICE)`), then `refit_cuda_engine_async` on the stream every run of
    the engine is queued on — nothing is copied from the host. `fill(names)` gives device weights for weights
    TensorRT fused with the given ones (their base values). `changed`: the names that now differ from base.
    The device memory must stay allocated until the refit has run on the stream (free it on that stream's
    order: after a synchronize)."""
    import tensorrt as trt

    name = engine.manifest.spec_name
    refitter = _device_refitter(engine)

    def put(items: Mapping[str, DeviceWeights]) -> None:
        rejected = []
        for weight, held in items.items():  # typed as the engine's own weights (uploaded already cast to them)
            prototype = refitter.get_weights_prototype(weight)
            if int(prototype.size) != held.count or not refitter.set_named_weights(
                    weight, trt.Weights(prototype.dtype, held.pointer, held.count), trt.TensorLocation.DEVICE):
                rejected.append(weight)
        if rejected:
            raise RefitError(f"TensorRT rejected device weight(s) {rejected} for engine {name}")

    put(weights)
    missing = [n for n in refitter.get_missing_weights() if n]
    if missing and fill is not None:
        put(fill(missing))
    _refit_cuda_engine(engine, refitter, weights, stream_handle)
    engine.refitted_names = set(changed)


def refit_engine(
    engine: TensorRTEngine,
    weights: Mapping[str, np.ndarray],
    base_weights: Mapping[str, np.ndarray] | None = None,
    stream_handle: int | None = None,
) -> None:
    """Write new weights (by ONNX initializer name) into a refittable engine, in place.

    With `base_weights`, weights changed by an earlier refit but absent here return to base in
    the same refit, and weights TensorRT fused with the given ones are filled from base. Without
    them, any such weight is a RefitError rather than a silent residue. (`refit_from_base` restores
    every weight from the ONNX file instead: what `trt-diffusion refit` uses.)
    """
    name = engine.manifest.spec_name
    wanted = weights_for_refit(name, engine.refitted_names, weights, base_weights)
    if not wanted:
        return
    refitter = _refitter(engine)
    # `prepared` holds the arrays TensorRT reads from until refit_cuda_engine returns (Weights do not copy)
    prepared = prepare_refit_weights(name, _prototypes(refitter, wanted), wanted)
    _set_named_weights(refitter, prepared, name)
    prepared.update(_fill_missing_weights(refitter, name, base_weights))
    _refit_cuda_engine(engine, refitter, wanted, stream_handle)
    engine.refitted_names = set(weights)


def _fill_missing_weights(
    refitter: trt.Refitter, engine_name: str, base_weights: Mapping[str, np.ndarray] | None
) -> dict[str, np.ndarray]:
    missing = [n for n in refitter.get_missing_weights() if n]
    if not missing or base_weights is None:
        return {}
    fill = {n: base_weights[n] for n in missing if n in base_weights}
    prepared = prepare_refit_weights(engine_name, _prototypes(refitter, fill), fill)
    _set_named_weights(refitter, prepared, engine_name)
    return prepared


def refit_to_base(
    engine: TensorRTEngine,
    base_weights: Mapping[str, np.ndarray],
    names: Iterable[str] | None = None,
    stream_handle: int | None = None,
) -> None:
    """Restore base weights: by default those refitted since the plan was built (its manifest's record
    and this process's refits); pass `names=refittable_weight_names(engine)` to restore everything.
    `stream_handle`: queued on that stream (a serving runner's), as `refit_engine` does: the synchronous refit is
    undefined while the engine has work queued (NvInferRuntime.h, IRefitter::refitCudaEngine)."""
    restore = sorted(engine.refitted_names if names is None else set(names))
    absent = [n for n in restore if n not in base_weights]
    if absent:
        raise RefitError(f"cannot restore engine {engine.manifest.spec_name}: the base weights lack {absent[:10]}")
    refit_engine(engine, {n: base_weights[n] for n in restore}, base_weights, stream_handle=stream_handle)
    engine.refitted_names = set()


def refit_quantized_from_base(
    engine: TensorRTEngine,
    base_onnx: str | Path,
    weights: Mapping[str, np.ndarray],
) -> None:
    """An fp8/int8 engine: every refittable weight from the base ONNX, then the LoRA'd weights *with their
    recomputed weight scales* (`lora.quantized_refit`: float weights and float8 codes, scales as Constant or
    initializer names) over them, in one refit; the calibrated activation scales are left as built.

    A weight or scale the engine cannot refit by name (TensorRT folded it into a kernel) is refused, naming
    them: a refit of the weight without its scale would keep the base weight's range.
    """
    import tensorrt as trt

    name = engine.manifest.spec_name
    refitter = _refitter(engine, base_only=not weights)
    absent = sorted(set(weights) - set(refitter.get_all_weights()))
    if absent:
        raise RefitError(f"cannot refit the quantized engine {name}: TensorRT has no refittable weight named "
                         f"{absent[:5]}{' ...' if len(absent) > 5 else ''} ({len(absent)} in all); rebuild it with the "
                         "LoRA fused and recalibrated (mode: fused)")
    codes = {n: a for n, a in weights.items() if a.dtype.name == "float8_e4m3fn"}
    others = {n: a for n, a in weights.items() if n not in codes}
    parser_refitter = trt.OnnxParserRefitter(refitter, _trt_logger())
    mark = _ERRORS.mark()
    if not parser_refitter.refit_from_file(str(base_onnx)):
        said = [_parser_error_text(parser_refitter.get_error(i)) for i in range(parser_refitter.num_errors)]
        raise RefitError(_with_trt_errors(
            f"cannot restore engine {name} from {base_onnx}: " + ("; ".join(said) or "the ONNX refitter gave no reason"),
            mark))
    # `prepared` and `parser_refitter` hold the weights TensorRT reads until refit_cuda_engine returns
    prepared = prepare_refit_weights(name, _prototypes(refitter, others), others) if others else {}
    _set_named_weights(refitter, prepared, name)
    for weight, array in codes.items():  # float8 codes: numpy has no FP8 dtype, TensorRT takes the bytes
        prototype = refitter.get_weights_prototype(weight)
        if prototype.dtype != trt.DataType.FP8 or int(prototype.size) != array.size:
            raise RefitError(f"cannot refit engine {name}: {weight} is held as {_dtype_name(prototype.dtype)} x "
                             f"{int(prototype.size)}, the refit gives float8 x {array.size}")
        raw = np.ascontiguousarray(array).view(np.uint8)
        prepared[weight] = raw
        if not refitter.set_named_weights(weight, trt.Weights(trt.DataType.FP8, raw.ctypes.data, raw.size)):
            raise RefitError(f"TensorRT rejected weight {weight} for engine {name}")
    _refit_cuda_engine(engine, refitter, refitter.get_all_weights())
    del parser_refitter
    engine.refitted_names = set(prepared)


def refit_from_base(
    engine: TensorRTEngine,
    base_onnx: str | Path,
    weights: Mapping[str, np.ndarray] | None = None,
    stream_handle: int | None = None,
) -> None:
    """Every refittable weight from the base ONNX, then `weights` over them, in one refit.

    `OnnxParserRefitter.refit_from_file` sets each weight the engine can refit from the ONNX the plan was
    built from: initializers, Constant-node values and the weights the parser itself made (folded or fused
    ones that have no initializer of their own), which no list of ONNX initializers covers. So nothing of
    an earlier LoRA can stay behind, whatever the manifest says. `weights` (ONNX initializer names, e.g.
    LoRA-fused weights) then replace their base values before `refit_cuda_engine`.
    """
    import tensorrt as trt

    name = engine.manifest.spec_name
    refitter = _refitter(engine, base_only=not weights)
    parser_refitter = trt.OnnxParserRefitter(refitter, _trt_logger())
    mark = _ERRORS.mark()
    if not parser_refitter.refit_from_file(str(base_onnx)):
        said = [_parser_error_text(parser_refitter.get_error(i)) for i in range(parser_refitter.num_errors)]
        raise RefitError(_with_trt_errors(
            f"cannot restore engine {name} from {base_onnx}: " + ("; ".join(said) or "the ONNX refitter gave no reason")
            + " (is it the ONNX the engine was built from?)", mark))
    # `prepared` and `parser_refitter` hold the weights TensorRT reads until refit_cuda_engine returns
    prepared = prepare_refit_weights(name, _prototypes(refitter, weights), weights) if weights else {}
    _set_named_weights(refitter, prepared, name)
    _refit_cuda_engine(engine, refitter, refitter.get_all_weights(), stream_handle)
    del parser_refitter
    engine.refitted_names = set(prepared)
