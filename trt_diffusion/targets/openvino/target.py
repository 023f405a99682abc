"""The `openvino` Target: the protocol of targets/base.py over engine.py (build) and runner.py (run)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError, ServeError
from ...onnx_facts import onnx_sha256
from ...precision import Precision, is_quantized
from ..base import BuildRequest, BuiltEngine, TargetBase, TritonEngineModel
from . import host, precision
from .engine import (
    FOLDERS,
    MANIFEST_FILE,
    MODEL_FILE,
    TARGET,
    WEIGHTS_FILE,
    build_engine,
    build_input_hash,
    cache_blob_path,
    cache_dir,
    engine_dir,
    read_manifest,
    trusted_engine,
    verify,
)
from .runner import OpenVINORunner

TRITON_CACHE_FOLDER = "openvino-cache"  # in a Triton model's version folder, when the packaged blob does not fit


def _refit_constants(folder: Path) -> tuple[str, ...]:
    """The refit map's initializers that are named Constants of the IR (conv and linear weights; OpenVINO
    folds biases and norm weights into other constants when it converts the ONNX)."""
    import openvino as ov

    from ...lora import RefitMap

    refit_map = RefitMap.load(folder)
    wanted = {t.initializer for t in refit_map.targets.values()}
    model = ov.Core().read_model(str(folder / MODEL_FILE))
    found = set()
    for op in model.get_ops():
        if op.get_type_name() == "Constant":
            found |= wanted & set(op.output(0).get_names())
    return tuple(sorted(found))


def _instance_count(model_folder: Path) -> int:
    """Instances of this Triton model (its config.pbtxt's instance_group counts), 1 when unknown."""
    try:
        text = (model_folder / "config.pbtxt").read_text()
    except OSError:
        return 1
    counts = [int(n) for n in re.findall(r"instance_group[^}]*?count:\s*(\d+)", text, flags=re.S)]
    return max(1, sum(counts)) if counts else 1


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


class OpenVINOTarget(TargetBase):
    """Engines as OpenVINO IR at the bucket's shape, for Intel (and ARM) CPUs: bf16 with AMX, int8 from Q/DQ."""

    name = TARGET

    def unavailable_reason(self) -> str | None:
        return host.unavailable_reason()

    def build_options(self, config) -> dict:
        return {}

    def fallback_precision(self) -> str:
        """fp32: fp16 is computed natively only by AVX512-FP16/AMX-FP16 Xeons and ARMv8.2 (refused elsewhere, as
        bf16 is without AVX512-BF16/AMX), and a plan is the same on every host: a family's defaults must build on
        any CPU. A component declared fp16 or bf16 is built as declared where the CPU computes it."""
        return Precision.fp32

    def plan_note(self, precision_name: str) -> str:
        """What `plan` shows beside this target's rows: what runs here, and on other CPUs."""
        if host.unavailable_reason() is not None:
            return precision.plan_note(precision_name)
        facts = host.cpu_facts()
        return precision.plan_note(precision_name, facts.capabilities, facts.device_name)

    def build(self, request: BuildRequest) -> tuple[Path, bool]:
        if request.spec.refittable and is_quantized(request.spec.precision):
            # measured: converting the Q/DQ ONNX, OpenVINO folds every quantized weight with its scales into
            # its own low-precision constants (int8: no weight or scale name is left; fp8: no scale name)
            raise BuildError(f"{request.spec.name}: the openvino target cannot refit {request.spec.precision} "
                             "engines (OpenVINO folds the quantized weights and their scales into its own constants); "
                             "use a fused LoRA (mode: fused), or the onnxruntime or tensorrt target for the refit")
        writer = request.write_refit_map

        def before_commit(folder: Path) -> tuple[str, ...]:
            if writer is None:
                return ()
            writer(request.onnx_path, folder)
            return _refit_constants(folder)

        folder, _, cached = build_engine(request.onnx_path, request.spec, request.profile, request.workspace,
                                         before_commit=before_commit)
        return folder, cached

    def is_current(self, request: BuildRequest) -> bool:
        if host.unavailable_reason() is not None:
            return False
        folder = engine_dir(request.workspace, request.spec)
        source = onnx_sha256(request.onnx_path)
        return trusted_engine(folder, build_input_hash(source, request.spec, host.cpu_facts())) is not None

    def find(self, workspace: Path, spec: EngineSpec) -> BuiltEngine | None:
        return FOLDERS.find(workspace, spec)

    def runner(self, engine: BuiltEngine, weights=None):
        verify(Path(engine.path), engine.manifest, where=engine.spec.name)
        constants = self._constants(engine, weights) if weights else None
        cache = cache_dir(Path(engine.path).parent.parent, host.cpu_facts())
        return OpenVINORunner(engine.path, name=engine.spec.name, cache=cache, constants=constants)

    def refit(self, engine: BuiltEngine, weights, source_onnx) -> int:
        # Like onnxruntime: the refit happens when a runner is created (weight constants of the IR replaced
        # in memory, then compiled); check the LoRA fits and compile it once, exactly what a server does.
        verify(Path(engine.path), engine.manifest, where=engine.spec.name)
        constants = self._constants(engine, weights) if weights else {}
        OpenVINORunner(engine.path, name=engine.spec.name, constants=constants)
        return len(constants)

    def triton_model(self, engine: BuiltEngine, *, engine_backend: str) -> TritonEngineModel:
        folder = Path(engine.path)
        manifest = engine.manifest
        where = f"{engine.spec.name}: {folder / MANIFEST_FILE}"
        files = {name: folder / name for name in (MODEL_FILE, WEIGHTS_FILE, MANIFEST_FILE)}
        missing = [name for name, path in files.items() if not path.is_file()]
        if missing:
            raise ServeError(f"{folder} is not a complete openvino engine ({', '.join(missing)} missing); rebuild it")
        blob_name = manifest.cache_blob
        blob_path = cache_blob_path(folder, manifest, where, ServeError)  # checked before anything is read
        try:
            verify(folder, manifest, where=engine.spec.name)
        except BuildError as exc:
            raise ServeError(str(exc)) from None
        if engine_backend == "native":
            return self._native_model(engine, files)
        if blob_path is not None and host.unavailable_reason() is None:
            blob = cache_blob_path(cache_dir(folder.parent.parent, host.cpu_facts()), manifest, where, ServeError)
            if blob.is_file():  # the compiled model: a server on this CPU starts without compiling
                files[blob_name] = blob
        if (folder / "refit_map.json").is_file():
            files["refit_map.json"] = folder / "refit_map.json"
        return TritonEngineModel("python", "KIND_CPU", files)

    def runner_from_files(self, folder: Path, name: str, *, device: int | None = None):  # KIND_CPU: no device
        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest is None:
            raise BuildError(f"{folder} holds no valid openvino {MANIFEST_FILE}; package the repository again")
        verify(folder, manifest, where=name)
        facts = host.cpu_facts()
        blob = cache_blob_path(folder, manifest, f"{name}: {folder / MANIFEST_FILE}", BuildError)
        if blob is not None and blob.is_file() and manifest.cpu_fingerprint == facts.fingerprint():
            cache = folder  # the blob packaged beside the IR was compiled by this OpenVINO on this CPU
        else:
            cache = folder / TRITON_CACHE_FOLDER / facts.fingerprint()
            cache = cache if _writable(cache) else None
        # Each Triton instance is its own process: share the cores among the model's instances.
        threads = max(1, host.available_cores() // _instance_count(folder.parent))
        return OpenVINORunner(folder, name=name, threads=threads, cache=cache)

    def lora_runner(self, folder: Path, name: str, weights, *, base=None):
        # the IR read again with the weight constants replaced, compiled with the base instance's threads (no
        # cache: each set would leave a compiled blob behind)
        from ...lora import RefitMap, refit_arrays

        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest is None:
            raise BuildError(f"{folder} holds no valid openvino {MANIFEST_FILE}; package the repository again")
        refit_map = RefitMap.load(folder)
        refit_map.check_onnx_sha256(manifest.onnx_sha256, f"the ONNX {name} was built from")
        threads = getattr(base, "threads", None) or max(1, host.available_cores() // _instance_count(folder.parent))
        return OpenVINORunner(folder, name=name, threads=threads, constants=refit_arrays(refit_map, weights))

    @staticmethod
    def _native_model(engine: BuiltEngine, files) -> TritonEngineModel:
        manifest = engine.manifest
        if manifest.inference_precision_hint != precision.HINT_BF16:
            raise ServeError(
                f"{engine.spec.name}: Triton's openvino backend cannot serve this {manifest.precision} engine "
                f"as built ({manifest.compute}): its only precision setting is HINT_BF16, so on AMX CPUs "
                "OpenVINO's default would compute it in bf16 under the fp32 name; package with "
                "--engine-backend python (the runner sets the precision itself)")
        parameters = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "HINT_BF16": "YES"}
        return TritonEngineModel("openvino", "KIND_CPU", {MODEL_FILE: files[MODEL_FILE], WEIGHTS_FILE: files[WEIGHTS_FILE]},
                                 MODEL_FILE, notes=(
            'backend "openvino" engine models need a Triton container with the OpenVINO backend (NVIDIA\'s '
            "tritonserver images); the tritonserver bundled in nvidia-pytriton has only the python backend",
            "with several instances of one engine model, set its INFERENCE_NUM_THREADS parameter to the cores "
            "divided by the instances so they do not oversubscribe the CPU"), parameters=parameters)

    @staticmethod
    def _constants(engine: BuiltEngine, weights) -> dict:
        from ...lora import RefitMap, refit_arrays

        refit_map = RefitMap.load(engine.path)
        refit_map.check_onnx_sha256(engine.manifest.onnx_sha256, f"the ONNX {engine.spec.name} was built from")
        return refit_arrays(refit_map, weights)

