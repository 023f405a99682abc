"""The ONNX Runtime runner: one InferenceSession over an engine folder's model (CPU by default)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .runner_base import BaseRunner, TensorSpec

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
            options = ort.SessionOptions()
            options.log_severity_level = 3
            session = ort.InferenceSession(str(self.path), options, providers=list(providers or ["CPUExecutionProvider"]))
        self.session = session
        self.inputs = {i.name: TensorSpec(np.dtype(_ORT_TYPES.get(i.type, np.float32)), tuple(i.shape))
                       for i in session.get_inputs()}
        self.output_names = [o.name for o in session.get_outputs()]

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(self.output_names, feeds)
        return dict(zip(self.output_names, values))
