"""The ONNX Runtime runner: one InferenceSession over an engine folder's model (CPU by default), and loading
one over a built engine, its bytes verified (with a LoRA's weights replacing a refittable engine's)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...errors import BuildError
from ...tensors import TensorSpec
from ..runner_base import BaseRunner
from .engine import MANIFEST_FILE, MODEL_FILE, disable_optimizers, read_manifest, verify

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}


class OnnxRuntimeRunner(BaseRunner):
    """One ONNX Runtime session. CPU by default; CUDA where onnxruntime-gpu is installed and asked for."""

    def __init__(self, onnx_path: str | Path, *, name: str | None = None, providers: Sequence[str] | None = None,
                 session=None):
        import onnxruntime as ort

        self.path = Path(onnx_path)
        self.name = name or self.path.name
        if session is None:
            session = ort.InferenceSession(str(self.path), session_options(),
                                           providers=list(providers or ["CPUExecutionProvider"]))
        self.session = session
        self.inputs = {i.name: TensorSpec(np.dtype(_ORT_TYPES.get(i.type, np.float32)), tuple(i.shape))
                       for i in session.get_inputs()}
        self.output_names = [o.name for o in session.get_outputs()]

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, feeds)
        return dict(zip(self.output_names, values))


def session_options(disabled_optimizers: tuple[str, ...] = ()):
    """`disabled_optimizers`: what the engine's manifest says its sessions run without (engine.py: fp8's)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    disable_optimizers(options, disabled_optimizers)
    options.log_severity_level = 3
    # A pipeline runs its sessions one after another: a session's idle workers spinning for more work after its
    # run take the cores the next session's run needs (mid-size FLUX, 2 cores, 20 steps, interleaved in one
    # process: first-block caching's two graphs per step 7.85 -> 7.13 s; one graph per step 6.90 -> 6.96 s,
    # unchanged). Off, a worker sleeps until it has work; waking it costs more than an operator of microseconds (the
    # tiny test models: 25.5 -> 30.4 ms for 20 steps), less than the milliseconds of a real model's operators.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def load_runner(folder: str | Path, *, name: str | None = None, providers=None, initializers=None):
    """An OnnxRuntimeRunner over a built engine; `initializers` (ONNX name -> array) replaces weights of a
    refittable engine: the LoRA refit of the onnxruntime target."""
    import onnxruntime as ort

    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise BuildError(f"{folder} is not a complete onnxruntime engine (no valid {MANIFEST_FILE}); rebuild it "
                         "with `trt-diffusion build engines.yaml --target onnxruntime`")
    verify(folder, manifest, where=name or folder.name)  # every load reads the bytes it runs
    providers = list(providers or ["CPUExecutionProvider"])

    def options():
        return session_options(manifest.disabled_optimizers)

    if initializers:
        from ...lora import onnxruntime_session

        session = onnxruntime_session(folder / MODEL_FILE, initializers, providers=providers, session_options=options)
    else:
        session = ort.InferenceSession(str(folder / MODEL_FILE), options(), providers=providers)
    return OnnxRuntimeRunner(folder / MODEL_FILE, name=name or folder.name, session=session)
