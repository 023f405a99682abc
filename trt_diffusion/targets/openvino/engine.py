"""Building an openvino engine: the exported ONNX (the Q/DQ ONNX for int8/fp8) converted to OpenVINO IR,
reshaped to the bucket's shape, compiled once through the model cache, sealed by a manifest.

Layout: `<workspace>/engines/openvino/<spec.name>.<spec.key>/{model.xml, model.bin, manifest.json[, refit_map.json]}`
and the compiled-model cache in `<workspace>/engines/openvino-cache/<OpenVINO + CPU fingerprint>/`; the folder
is built and sealed as every folder engine is (targets/engine_folder.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from ...onnx_facts import ProfileShapes, onnx_io, onnx_sha256, validate_profile
from ...tensors import TensorSpec
from ...workspace.files import update_digest
from ...workspace.manifests import MANIFEST_FILE  # noqa: F401  (re-exported: the target serves it)
from ...workspace.safe_paths import inside_folder
from ..engine_folder import EngineFolders, FolderEngineManifest, input_hash
from . import host, precision

TARGET = "openvino"
MANIFEST_SCHEMA_VERSION = 1
MODEL_FILE = "model.xml"
WEIGHTS_FILE = "model.bin"
CACHE_FOLDER = "openvino-cache"

_OV_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i64": "int64", "i32": "int32",
             "boolean": "bool", "u8": "uint8", "i8": "int8"}


class OpenVINOEngineManifest(FolderEngineManifest):
    schema_version: int = MANIFEST_SCHEMA_VERSION
    target: str = TARGET
    precision: str  # as engines.yaml asks
    openvino_version: str
    cpu: str  # FULL_DEVICE_NAME
    cpu_architecture: str
    cpu_capabilities: tuple[str, ...]  # OPTIMIZATION_CAPABILITIES at build time
    cpu_isa_flags: tuple[str, ...]
    cpu_fingerprint: str  # OpenVINO version + CPU: names the compiled-model cache folder
    inference_precision_hint: str  # what the target sets: f32 | bf16 | f16
    quantized: str | None  # i8 | f8-emulated | None
    compute: str  # one line: what runs
    runtime_precisions: dict[str, int]  # heavy layers by the precision they ran in when compiled at build
    refit_constants: tuple[str, ...] = ()
    cache_blob: str | None = None  # the compiled model's file name in the cache folder (valid for cpu_fingerprint)
    compile_seconds: float


def cache_dir(engines_root: Path, facts: host.CpuFacts) -> Path:
    """`engines_root` is `<workspace>/engines`: one cache folder per OpenVINO version and CPU."""
    return Path(engines_root) / CACHE_FOLDER / facts.fingerprint()


def build_input_hash(source_sha256: str, spec: EngineSpec, facts: host.CpuFacts) -> str:
    """Source ONNX bytes, spec key, OpenVINO version, CPU fingerprint, schema."""
    return input_hash({"onnx": source_sha256, "spec": spec.key, "openvino": facts.openvino_version,
                       "cpu": facts.fingerprint(), "schema": MANIFEST_SCHEMA_VERSION})


def engine_sha256(folder: Path) -> str:
    """model.xml + model.bin under one digest."""
    digest = hashlib.sha256()
    for name in (MODEL_FILE, WEIGHTS_FILE):
        update_digest(digest, Path(folder) / name)
    return digest.hexdigest()


FOLDERS = EngineFolders(TARGET, OpenVINOEngineManifest, engine_sha256)
engine_dir = FOLDERS.folder
read_manifest = FOLDERS.read
trusted_engine = FOLDERS.trusted  # a complete engine built from exactly these inputs on this OpenVINO and CPU
verify = FOLDERS.verify  # BuildError unless the folder holds the bytes its manifest records


def cache_blob_path(folder: Path, manifest: OpenVINOEngineManifest, where: str, error) -> Path | None:
    """`folder / manifest.cache_blob` once the name is checked to be a plain file name of that folder (a
    manifest from a shared workspace is input: `../../Makefile` or `/etc/x` must not be read or written)."""
    if manifest.cache_blob is None:
        return None
    return inside_folder(folder, manifest.cache_blob, where=where, field="cache_blob", error=error, name_only=True)


def port_named(ports, name: str):
    """The port carrying the ONNX tensor `name` (OpenVINO may give a port several names)."""
    for port in ports:
        if name in port.get_names():
            return port
    raise BuildError(f"the OpenVINO model has no tensor named {name!r}")


def tensor_specs(ports, names) -> tuple[TensorSpec, ...]:
    """The ONNX graph's inputs or outputs, by their ONNX names, with the compiled ports' types and shapes."""
    infos = []
    for name in names:
        port = port_named(ports, name)
        dims = tuple(d.get_length() if d.is_static else -1 for d in port.get_partial_shape())
        infos.append(TensorSpec(name=name, dtype=_OV_TYPES.get(port.get_element_type().get_type_name(), "float32"),
                                shape=dims))
    return tuple(infos)


def _reshape(model, profile: ProfileShapes) -> None:
    """Fix every profiled input to its shape (static buckets) or to its bounds (range buckets)."""
    import openvino as ov

    ports = {}
    for port in model.inputs:
        for name in port.get_names():
            ports[name] = port
    unknown = sorted(set(profile) - set(ports))
    if unknown:
        raise BuildError(f"the profile names input(s) the ONNX does not have: {unknown} (its inputs: {sorted(ports)})")
    shapes = {}
    for name, (lo, _, hi) in profile.items():
        shapes[ports[name]] = ov.PartialShape([ov.Dimension(a) if a == b else ov.Dimension(a, b) for a, b in zip(lo, hi)])
    try:
        model.reshape(shapes)
    except RuntimeError as exc:
        raise BuildError(f"OpenVINO cannot reshape the model to the bucket's shapes {dict(profile)}: "
                         f"{str(exc).splitlines()[0]}") from None


def compile_config(compute: precision.Compute, threads: int | None) -> dict[str, str]:
    """The compile properties: precision set explicitly (never OpenVINO's CPU-dependent default), one
    stream and a latency hint (one request at a time per engine), and the thread count."""
    config = {"INFERENCE_PRECISION_HINT": compute.hint, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    return config


def build_engine(onnx_path: str | Path, spec: EngineSpec, profile: ProfileShapes, workspace: str | Path,
                 before_commit: Callable[[Path], tuple[str, ...]] | None = None
                 ) -> tuple[Path, OpenVINOEngineManifest, bool]:
    """Build (or find) the engine for `spec`: (folder, manifest, cached). `before_commit(folder)` may add
    files (the refit map) and returns the refittable constant names the manifest records."""
    ov = host.require_openvino()
    facts = host.cpu_facts()
    compute = precision.resolve(spec.precision, facts.capabilities, facts.device_name)
    profile = validate_profile(profile)
    source_sha = onnx_sha256(onnx_path)
    source_inputs, source_outputs = onnx_io(onnx_path)
    built_from = build_input_hash(source_sha, spec, facts)

    def make(tmp: Path, final: Path, start: float) -> OpenVINOEngineManifest:
        try:
            model = ov.convert_model(str(onnx_path))
        except Exception as exc:  # noqa: BLE001 - the frontend raises its own types
            raise BuildError(f"{spec.name}: OpenVINO cannot convert {onnx_path}: {str(exc).splitlines()[0]}") from None
        _reshape(model, profile)
        # compress_to_fp16 defaults to True: it would store an fp32 engine's weights in fp16.
        ov.save_model(model, str(tmp / MODEL_FILE), compress_to_fp16=False)
        del model
        refit_constants = before_commit(tmp) if before_commit is not None else ()
        # Compile once into a fresh cache folder: its one blob is this engine's compiled model. OpenVINO keys
        # blobs of in-memory models by content and compile settings (not by path, not by thread count), so
        # every later load of this IR on this OpenVINO and CPU finds it.
        compile_start = time.perf_counter()
        core = ov.Core()
        core.set_property({"CACHE_DIR": str(tmp / ".compiled")})
        try:
            compiled = core.compile_model(core.read_model(str(tmp / MODEL_FILE)), "CPU", compile_config(compute, None))
        except RuntimeError as exc:
            raise BuildError(f"{spec.name}: OpenVINO cannot compile the engine: {str(exc).splitlines()[0]}") from None
        compile_seconds = time.perf_counter() - compile_start
        blobs = sorted((tmp / ".compiled").glob("*.blob"))
        cache_blob = blobs[0].name if len(blobs) == 1 else None
        if cache_blob:
            shared = cache_dir(final.parent.parent, facts)
            shared.mkdir(parents=True, exist_ok=True)
            os.replace(blobs[0], shared / cache_blob)  # content-addressed: replacing an equal blob is harmless
        shutil.rmtree(tmp / ".compiled", ignore_errors=True)
        inputs = tensor_specs(compiled.inputs, [t.name for t in source_inputs])
        outputs = tensor_specs(compiled.outputs, [t.name for t in source_outputs])
        runtime_precisions = precision.runtime_precisions(compiled)
        del compiled
        return FOLDERS.seal(
            tmp, final, spec=spec, built_from=built_from, onnx_sha256=source_sha, profile=profile, inputs=inputs,
            outputs=outputs, started=start, precision=spec.precision, openvino_version=facts.openvino_version,
            cpu=facts.device_name, cpu_architecture=facts.architecture, cpu_capabilities=facts.capabilities,
            cpu_isa_flags=facts.isa_flags, cpu_fingerprint=facts.fingerprint(), inference_precision_hint=compute.hint,
            quantized=compute.quantized, compute=compute.summary, runtime_precisions=runtime_precisions,
            refit_constants=tuple(refit_constants), cache_blob=cache_blob, compile_seconds=compile_seconds)

    return FOLDERS.build(workspace, spec, built_from, make)
