"""Building an onnxruntime engine: one ONNX per engine shape, its dimensions fixed to the bucket and ONNX
Runtime's offline graph optimizations saved, sealed by a manifest like a TensorRT engine's.

Layout: `<workspace>/engines/onnxruntime/<spec.name>.<spec.key>/{model.onnx, model.onnx.data, manifest.json}`,
built and sealed as every folder engine is (targets/engine_folder.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from ...onnx_facts import ProfileShapes, onnx_io, onnx_sha256, validate_profile
from ...precision import Precision
from ...workspace.manifests import MANIFEST_FILE
from ..engine_folder import EngineFolders, FolderEngineManifest, input_hash, is_static

if TYPE_CHECKING:
    import onnx

TARGET = "onnxruntime"
MANIFEST_SCHEMA_VERSION = 1
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# Saved graphs use the portable optimization level: ENABLE_ALL adds layout-specific kernels (NCHWc) tied
# to the building CPU. ENABLE_ALL still runs when a session is created on the serving host.
SAVED_OPTIMIZATION = "extended"
# ONNX Runtime's QDQPropagationTransformer, on an fp8 Q/DQ graph with fixed shapes (the engines'), with
# MatMulAddFusion loses the graph's precision: the SD1.5 micro-model's fp8 UNet, one call against its fp32 graph,
# 41.7 dB with the shapes dynamic or with either optimizer off, 25.2 dB with both on (onnxruntime 1.24; int8 Q/DQ
# unaffected, 50 dB either way); over 20 steps the images collapsed (4-12 dB). Propagating fp8 Q/DQ buys nothing on
# a CPU, which has no fp8 kernels: fp8 engines are optimized, offline and in every session, without it.
FP8_DISABLED_OPTIMIZERS = ("QDQPropagationTransformer",)


def disabled_optimizers(spec: EngineSpec) -> tuple[str, ...]:
    return FP8_DISABLED_OPTIMIZERS if spec.precision == Precision.fp8 else ()


class OrtEngineManifest(FolderEngineManifest):
    schema_version: int = MANIFEST_SCHEMA_VERSION
    target: str = TARGET
    onnxruntime_version: str
    offline_optimization: str | None  # None: a refittable engine, the exported graph as it is
    disabled_optimizers: tuple[str, ...] = ()  # ONNX Runtime optimizers every session of it runs without


def _engine_sha256(folder: Path) -> str:
    return onnx_sha256(folder / MODEL_FILE)  # the engine's model.onnx (+ data)


FOLDERS = EngineFolders(TARGET, OrtEngineManifest, _engine_sha256, unreadable=(BuildError,))
engine_dir = FOLDERS.folder
read_manifest = FOLDERS.read
trusted_engine = FOLDERS.trusted  # the manifest of a complete engine built from exactly these inputs, else None
verify = FOLDERS.verify  # BuildError unless the folder holds the bytes its manifest records


def build_input_hash(source_sha256: str, spec: EngineSpec) -> str:
    import onnxruntime

    payload = {"onnx": source_sha256, "spec": spec.key, "onnxruntime": onnxruntime.__version__,
               "offline_optimization": None if spec.refittable else SAVED_OPTIMIZATION,
               "schema": MANIFEST_SCHEMA_VERSION}
    if disabled_optimizers(spec):  # only there: the other engines' hashes (and builds) stand
        payload["disabled_optimizers"] = list(disabled_optimizers(spec))
    return input_hash(payload)


def build_engine(onnx_path: str | Path, spec: EngineSpec, profile: ProfileShapes, workspace: str | Path,
                 before_commit: Callable[[Path], None] | None = None) -> tuple[Path, OrtEngineManifest, bool]:
    """Build (or find) the engine for `spec`. Returns (folder, manifest, cached).

    `before_commit(folder)` may add files (a refit map) before the manifest seals the folder.
    """
    import onnx  # here, not at the top: listing targets (plan, the CLI) must not load onnx
    import onnxruntime

    profile = validate_profile(profile)
    source_sha = onnx_sha256(onnx_path)
    built_from = build_input_hash(source_sha, spec)

    def make(tmp: Path, final: Path, start: float) -> OrtEngineManifest:
        try:
            model = onnx.load(str(onnx_path), load_external_data=True)
            if is_static(profile):
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
                _optimize_offline(fixed, tmp / MODEL_FILE, disabled_optimizers(spec))
            for stale in (fixed, tmp / "fixed.onnx.data"):
                stale.unlink(missing_ok=True)
            if before_commit is not None:
                before_commit(tmp)
            inputs, outputs = onnx_io(tmp / MODEL_FILE)
            return FOLDERS.seal(tmp, final, spec=spec, built_from=built_from, onnx_sha256=source_sha,
                                profile=profile, inputs=inputs, outputs=outputs, started=start,
                                onnxruntime_version=onnxruntime.__version__,
                                offline_optimization=None if spec.refittable else SAVED_OPTIMIZATION,
                                disabled_optimizers=disabled_optimizers(spec))
        except onnx.checker.ValidationError as exc:
            raise BuildError(f"{spec.name}: the ONNX is invalid: {exc}") from None

    return FOLDERS.build(workspace, spec, built_from, make)


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


def _optimize_offline(source: Path, target: Path, disabled: tuple[str, ...] = ()) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    disable_optimizers(options, disabled)
    options.optimized_model_filepath = str(target)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA_FILE)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    options.log_severity_level = 3
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])


def disable_optimizers(options, names: tuple[str, ...]) -> None:
    if names:
        options.add_session_config_entry("optimization.disable_specified_optimizers", ",".join(names))


def engine_files(folder: Path, manifest: OrtEngineManifest) -> dict[str, Path]:
    """The files to serve: those the manifest records (every file, for older manifests), the manifest."""
    if manifest.file_sha256:
        files = {name: folder / name for name in sorted({*manifest.file_sha256, MANIFEST_FILE})}
    else:
        files = {f.name: f for f in sorted(folder.iterdir()) if f.is_file() and not f.name.startswith(".")}
    if MODEL_FILE not in files or MANIFEST_FILE not in files:
        raise BuildError(f"{folder} is not a complete onnxruntime engine ({MODEL_FILE} and {MANIFEST_FILE} needed)")
    return files
