"""The `onnxruntime` Target: the protocol of targets/base.py over engine.py (build) and runner.py (run)."""

from __future__ import annotations

from pathlib import Path

from ...engines_file.engine_spec import EngineSpec
from ...onnx_facts import onnx_sha256
from ..base import BuildRequest, BuiltEngine, TargetBase, TritonEngineModel
from .engine import (
    FOLDERS,
    MODEL_FILE,
    TARGET,
    build_engine,
    build_input_hash,
    engine_dir,
    engine_files,
    trusted_engine,
    verify,
)


def load_runner(folder: Path, **options):
    """runner.load_runner, imported when a runner is wanted: knowing the target loads neither numpy nor ORT."""
    from .runner import load_runner as load

    return load(folder, **options)


class OnnxRuntimeTarget(TargetBase):
    """Engines as fixed-shape, offline-optimized ONNX, run by ONNX Runtime (CPU here; CUDA where installed)."""

    name = TARGET

    def unavailable_reason(self) -> str | None:
        import importlib.util

        return None if importlib.util.find_spec("onnxruntime") else "the onnxruntime package is not installed"

    def build_options(self, config) -> dict:
        return {}

    def fallback_precision(self) -> str:
        """fp32: the engines are optimized offline for ONNX Runtime's CPU execution provider, which has no fp16
        kernels for most of a denoiser's operators on x86 and runs them in fp32 between casts it inserts (the
        micro-model's fp16 UNet engine: 1407 Cast nodes of 3407, 25.4 ms a call against fp32's 24.5 ms). The
        file-wide fp16 fallback would cost a second export and precision for nothing; a component declared fp16
        is built as declared."""
        from ...precision import Precision

        return Precision.fp32

    def build(self, request: BuildRequest) -> tuple[Path, bool]:
        writer = request.write_refit_map
        before_commit = (lambda folder: writer(folder / MODEL_FILE, folder)) if writer else None
        folder, _, cached = build_engine(request.onnx_path, request.spec, request.profile, request.workspace,
                                         before_commit=before_commit)
        return folder, cached

    def is_current(self, request: BuildRequest) -> bool:
        folder = engine_dir(request.workspace, request.spec)
        return trusted_engine(folder, build_input_hash(onnx_sha256(request.onnx_path), request.spec)) is not None

    def find(self, workspace: Path, spec: EngineSpec) -> BuiltEngine | None:
        return FOLDERS.find(workspace, spec)

    def runner(self, engine: BuiltEngine, weights=None):
        initializers = self._initializers(engine, weights) if weights else None
        return load_runner(engine.path, name=engine.spec.name, initializers=initializers)

    def refit(self, engine: BuiltEngine, weights, source_onnx) -> int:
        # ONNX Runtime refits when a session is created: check the LoRA fits and build that session,
        # exactly what a server does at load time. Nothing is written: the engine stays the base.
        arrays = self._initializers(engine, weights) if weights else {}
        load_runner(engine.path, name=engine.spec.name, initializers=arrays)
        return len(arrays)

    def triton_model(self, engine: BuiltEngine, *, engine_backend: str) -> TritonEngineModel:
        verify(Path(engine.path), engine.manifest, where=engine.spec.name)
        files = engine_files(Path(engine.path), engine.manifest)
        if engine_backend == "native":
            return TritonEngineModel("onnxruntime", "KIND_CPU", files, MODEL_FILE, notes=(
                'backend "onnxruntime" engine models need NVIDIA\'s Triton containers; the tritonserver bundled '
                "in nvidia-pytriton has only the python backend (package with --engine-backend python)",))
        return TritonEngineModel("python", "KIND_CPU", files)

    def runner_from_files(self, folder: Path, name: str, *, device: int | None = None):
        return load_runner(folder, name=name)  # KIND_CPU models: never given a device

    def lora_runner(self, folder: Path, name: str, weights, *, base=None):
        # a new session on the base ONNX with the changed initializers replaced (add_external_initializers);
        # the base session is left as it is
        from ...lora import RefitMap, refit_arrays

        folder = Path(folder)
        arrays = refit_arrays(RefitMap.load(folder, onnx_path=folder / MODEL_FILE), weights)
        return load_runner(folder, name=name, initializers=arrays)

    @staticmethod
    def _initializers(engine: BuiltEngine, weights) -> dict:
        from ...lora import RefitMap, refit_arrays

        refit_map = RefitMap.load(engine.path, onnx_path=engine.path / MODEL_FILE)
        return refit_arrays(refit_map, weights)
