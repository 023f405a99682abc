"""Build: one strongly typed engine per EngineSpec on TensorRT 10 and 11, straight through TensorRT's builder API
(precision comes from the ONNX: build_flags.BuildFlags), its manifest beside it and the timing cache updated."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError, MissingDependencyError
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
from . import host_probe, trt_log
from .build_flags import BuildFlags, network_creation_flags
from .dtypes import trt_dtype_name
from .host_gates import check_hardware, check_refit_supported
from .layout import profile_envelope
from .manifest import EngineManifest, manifest_path
from .plan_trust import plan_sha256
from .precision import check_onnx_precision
from .served_memory import onnx_weight_bytes
from .timing_cache import timing_cache_lock, timing_cache_path

if TYPE_CHECKING:  # TensorRT's own types (tensorrt-stubs in the test extra)
    import tensorrt as trt

LOG = logging.getLogger(__name__)


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


def _parse_onnx(onnx_path: Path, trt_version: str,
                spec_name: str) -> tuple[trt.Builder, trt.INetworkDefinition, trt.OnnxParser]:
    """(builder, network, parser); a BuildError carries the parser's own words."""
    import tensorrt as trt

    logger = trt_log.trt_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt_version))
    parser = trt.OnnxParser(network, logger)
    parsed = parser.parse_from_file(str(onnx_path))  # from a path, so external data is found beside it
    errors = [trt_log.parser_error_text(parser.get_error(i)) for i in range(parser.num_errors)]
    if not parsed or errors:
        detail = "\n  ".join(errors) or "the parser gave no reason"
        raise BuildError(f"{spec_name}: TensorRT could not parse {onnx_path}:\n  {detail}")
    return builder, network, parser


def _create_config(builder: trt.Builder, flags: BuildFlags, profiles: Sequence[ProfileShapes], cache_path: Path,
                   spec_name: str) -> trt.IBuilderConfig:
    """The builder config: flags, workspace, and one optimization profile per entry of `profiles` (one for a
    per-shape engine; one per bucket × batch shape for `engine_layout: profiles`, in the manifest's order)."""
    import tensorrt as trt

    mark = trt_log.ERRORS.mark()
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
            raise BuildError(trt_log.with_trt_errors(
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
    mark = trt_log.ERRORS.mark()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(trt_log.with_trt_errors(f"{spec_name}: TensorRT could not build the engine", mark))
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


def _tensor_specs(tensors: Iterable[trt.ITensor]) -> tuple[TensorSpec, ...]:
    def shape(dims: trt.Dims) -> tuple[int, ...]:
        return tuple(dims[i] for i in range(len(dims)))

    return tuple(TensorSpec(name=t.name, dtype=trt_dtype_name(t.dtype), shape=shape(t.shape)) for t in tensors)


def check_can_build(spec: EngineSpec) -> host_probe.CudaDevice:
    """The hardware gate, before TensorRT is started: BuildError naming the engine, its precision and the
    GPU when this GPU cannot run the precision (BF16 needs compute capability 8.0, FP8 8.9)."""
    device, reasons = host_probe.probe_cuda_device()
    if device is None:
        raise MissingDependencyError("no CUDA device: " + "; ".join(reasons) + f"; {host_probe.INSTALL_HINT}")
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
    host_probe.require_tensorrt()
    trt_version, compute_capability, device_name = host_probe.host_info()
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
        runtime = trt.Runtime(trt_log.trt_logger())
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
