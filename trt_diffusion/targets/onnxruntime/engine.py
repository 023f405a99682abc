"""Building an onnxruntime engine: one ONNX per engine shape, its dimensions fixed to the bucket and ONNX
Runtime's offline graph optimizations saved, sealed by a manifest like a TensorRT engine's.

Layout: `<workspace>/engines/onnxruntime/<spec.name>.<spec.key>/{model.onnx, model.onnx.data, manifest.json}`.
The folder is built beside its final place and renamed in, manifest written last, so an interrupted
build leaves nothing a later run trusts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from ...onnx_facts import ProfileShapes, TensorInfo, onnx_io, onnx_sha256, validate_profile
from ...workspace.manifests import (
    MANIFEST_FILE,
    read_folder_manifest,
    record_files,
    trusted_folder_manifest,
    verify_engine_folder,
)

if TYPE_CHECKING:
    import onnx

TARGET = "onnxruntime"
MANIFEST_SCHEMA_VERSION = 1
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# Saved graphs use the portable optimization level: ENABLE_ALL adds layout-specific kernels (NCHWc) tied
# to the building CPU. ENABLE_ALL still runs when a session is created on the serving host.
SAVED_OPTIMIZATION = "extended"


class OrtEngineManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = MANIFEST_SCHEMA_VERSION
    spec_key: str
    spec_name: str
    target: str = TARGET
    onnxruntime_version: str
    input_hash: str  # what this engine was built from: source ONNX bytes, spec key, ORT version, options
    onnx_sha256: str  # the source ONNX
    engine_sha256: str  # the engine's own model.onnx (+ data)
    static_shapes: bool
    offline_optimization: str | None
    profile_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    build_seconds: float
    created_at: str
    file_sha256: dict[str, str] = {}  # every file of the folder but the manifest (empty in older manifests)


def engine_dir(workspace: str | Path, spec: EngineSpec) -> Path:
    return Path(workspace) / "engines" / TARGET / f"{spec.name}.{spec.key}"


def build_input_hash(source_sha256: str, spec: EngineSpec) -> str:
    import onnxruntime

    payload = {"onnx": source_sha256, "spec": spec.key, "onnxruntime": onnxruntime.__version__,
               "offline_optimization": None if spec.refittable else SAVED_OPTIMIZATION,
               "schema": MANIFEST_SCHEMA_VERSION}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def read_manifest(folder: Path) -> OrtEngineManifest | None:
    return read_folder_manifest(folder, OrtEngineManifest)


def trusted_engine(folder: Path, input_hash: str) -> OrtEngineManifest | None:
    """The manifest of a complete engine built from exactly these inputs, else None."""
    return trusted_folder_manifest(folder, input_hash, OrtEngineManifest, lambda f: onnx_sha256(f / MODEL_FILE),
                                   unreadable=(BuildError,))


def build_engine(onnx_path: str | Path, spec: EngineSpec, profile: ProfileShapes, workspace: str | Path,
                 before_commit: Callable[[Path], None] | None = None) -> tuple[Path, OrtEngineManifest, bool]:
    """Build (or find) the engine for `spec`. Returns (folder, manifest, cached).

    `before_commit(folder)` may add files (a refit map) before the manifest seals the folder.
    """
    import onnx  # here, not at the top: listing targets (plan, the CLI) must not load onnx
    import onnxruntime

    profile = validate_profile(profile)
    source_sha = onnx_sha256(onnx_path)
    input_hash = build_input_hash(source_sha, spec)
    final = engine_dir(workspace, spec)
    manifest = trusted_engine(final, input_hash)
    if manifest is not None:
        return final, manifest, True
    start = time.perf_counter()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        static = all(lo == opt == hi for lo, opt, hi in profile.values())
        model = onnx.load(str(onnx_path), load_external_data=True)
        if static:
            fix_dimensions(model, {name: shapes[1] for name, shapes in profile.items()})
        fixed = tmp / "fixed.onnx"
        _save(model, fixed)
        if spec.refittable:
            # Refittable engines keep the exported graph with every float weight in external data: ONNX
            # Runtime replaces external initializers (add_external_initializers) *before* optimizing,
            # while add_initializer is applied after folding and silently changes nothing.
            from ...lora import externalize_weights

            externalize_weights(fixed, tmp / MODEL_FILE)
        else:
            _optimize_offline(fixed, tmp / MODEL_FILE)
        for stale in (fixed, tmp / "fixed.onnx.data"):
            stale.unlink(missing_ok=True)
        if before_commit is not None:
            before_commit(tmp)
        inputs, outputs = onnx_io(tmp / MODEL_FILE)
        manifest = OrtEngineManifest(
            spec_key=spec.key, spec_name=spec.name, onnxruntime_version=onnxruntime.__version__,
            input_hash=input_hash, onnx_sha256=source_sha, engine_sha256=onnx_sha256(tmp / MODEL_FILE),
            static_shapes=static, offline_optimization=None if spec.refittable else SAVED_OPTIMIZATION,
            profile_shapes={k: tuple(map(tuple, v)) for k, v in profile.items()}, inputs=inputs, outputs=outputs,
            build_seconds=time.perf_counter() - start, created_at=datetime.now(UTC).isoformat(),
            file_sha256=record_files(tmp),
        )
        (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except onnx.checker.ValidationError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"{spec.name}: the ONNX is invalid: {exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, manifest, False


def verify(folder: Path, manifest: OrtEngineManifest, *, where: str, full: bool = True) -> None:
    """BuildError unless the folder holds the bytes its manifest records (see manifests.verify_engine_folder)."""
    verify_engine_folder(folder, manifest, lambda f: onnx_sha256(f / MODEL_FILE), where=where, full=full,
                         files=manifest.file_sha256)


def fix_dimensions(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> None:
    """Set every input's dims to the bucket's shape, and every other use of the same symbols."""
    symbols: dict[str, int] = {}
    for value in model.graph.input:
        if value.name not in shapes:
            continue
        dims = value.type.tensor_type.shape.dim
        wanted = shapes[value.name]
        if len(dims) != len(wanted):
            raise BuildError(f"input {value.name!r} has rank {len(dims)} but the profile gives {list(wanted)}")
        for dim, size in zip(dims, wanted):
            if dim.dim_param:
                symbols[dim.dim_param] = size
            elif dim.dim_value and dim.dim_value != size:
                raise BuildError(f"input {value.name!r} is fixed at {dim.dim_value} where the profile wants {size}")
            dim.Clear()
            dim.dim_value = size
    for value in [*model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in symbols:
                size = symbols[dim.dim_param]
                dim.Clear()
                dim.dim_value = size


def _save(model: onnx.ModelProto, path: Path) -> None:
    import onnx

    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def _optimize_offline(source: Path, target: Path) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA_FILE)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    options.log_severity_level = 3
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])


def engine_files(folder: Path, manifest: OrtEngineManifest) -> dict[str, Path]:
    """The files to serve: those the manifest records (every file, for older manifests), the manifest."""
    if manifest.file_sha256:
        files = {name: folder / name for name in sorted({*manifest.file_sha256, MANIFEST_FILE})}
    else:
        files = {f.name: f for f in sorted(folder.iterdir()) if f.is_file() and not f.name.startswith(".")}
    if MODEL_FILE not in files or MANIFEST_FILE not in files:
        raise BuildError(f"{folder} is not a complete onnxruntime engine ({MODEL_FILE} and {MANIFEST_FILE} needed)")
    return files
