"""Load and run: a plan deserialized only after its manifest, its bytes (sha256) and this host's TensorRT and GPU are
checked (plan_trust.py, host_gates.py), streamed in chunks when large (plan_stream.py), a stripped plan refitted
from its ONNX before anything runs it; `run_engine` for one-off inferences (the production runner is runner.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from . import host_probe, trt_log
from . import refit as trt_refit
from .feeds import check_feeds
from .host_gates import check_engine_compatible
from .manifest import REBUILD_COMMAND, EngineManifest, manifest_path
from .plan_stream import STREAM_THRESHOLD_BYTES, load_mode, open_verified, privately_writable, stream_reader
from .plan_trust import check_plan_bytes, host_code_allowed, interrupted_refit_problem

if TYPE_CHECKING:  # TensorRT's own types (tensorrt-stubs in the test extra)
    import tensorrt as trt


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

    mark = trt_log.ERRORS.mark()
    runtime = trt.Runtime(trt_log.trt_logger())
    if allow_host_code:
        # a version-compatible plan carries its lean runtime (host code): only for a plan whose bytes matched
        # its manifest's sha256 and whose spec asks for it (plan_trust.host_code_allowed)
        runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise BuildError(trt_log.with_trt_errors(
            f"engine {manifest.spec_name} could not be deserialized: rebuild with `{REBUILD_COMMAND}`", mark))
    return engine


def load_engine(plan_path: str | Path, host: host_probe.HostInfo | None = None, *, spec: EngineSpec | None = None,
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
    trt_version, compute_capability, device_name = host if host is not None else host_probe.host_info(device)
    check_engine_compatible(manifest, trt_version, compute_capability, device_name)
    if not for_refit and (problem := interrupted_refit_problem(manifest)):
        raise BuildError(problem)
    _check_plan_file(plan_path, manifest, for_refit)
    trt_mod = host_probe.require_tensorrt()
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
        trt_refit.refit_from_base(loaded, weights_onnx)  # every stripped weight, from the ONNX the plan was built from
    return loaded


def _deserialize_streamed(trt_mod: ModuleType, plan_path: Path, manifest: EngineManifest, host_code: bool,
                          for_refit: bool) -> trt.ICudaEngine:
    """Verify through one open handle, then let TensorRT pull the plan from it in chunks, in any order it reads and
    seeks; an engine given a chunk that differed on the second read is dropped."""
    mark = trt_log.ERRORS.mark()
    verified = open_verified(plan_path, manifest, for_refit=for_refit)
    with verified.handle:
        source = verified.source()
        runtime = trt_mod.Runtime(trt_log.trt_logger())
        if host_code:
            runtime.engine_host_code_allowed = True
        engine = runtime.deserialize_cuda_engine(stream_reader(source))
        if engine is not None and not source.verdict():
            del engine
            raise BuildError(f"engine plan {plan_path} changed while it was being loaded: rebuild or reload it")
    if engine is None:
        raise BuildError(trt_log.with_trt_errors(
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
