"""The Runner protocol and its implementations.

A runner checks names, dtypes and shapes before running and says what it expected, so a wrong feed is a
clear error instead of a backend's stack trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import RuntimeInputError

Dim = int | str | None  # a fixed size, or a symbolic/dynamic one


@dataclass(frozen=True)
class TensorSpec:
    dtype: np.dtype
    shape: tuple[Dim, ...]

    def describe(self) -> str:
        dims = ",".join(str(d) if isinstance(d, int) else (d or "?") for d in self.shape)
        return f"{np.dtype(self.dtype).name}[{dims}]"


class Runner(Protocol):
    name: str
    inputs: dict[str, TensorSpec]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def check_feeds(name: str, inputs: dict[str, TensorSpec], feeds: dict[str, np.ndarray]) -> None:
    missing = [k for k in inputs if k not in feeds]
    extra = [k for k in feeds if k not in inputs]
    problems = []
    if missing:
        problems.append(f"missing input(s) {missing}")
    if extra:
        problems.append(f"unexpected input(s) {extra}")
    for key, spec in inputs.items():
        if key not in feeds:
            continue
        value = feeds[key]
        if value.dtype != spec.dtype:
            problems.append(f"{key}: dtype {value.dtype.name}, expected {np.dtype(spec.dtype).name}")
        if len(value.shape) != len(spec.shape) or any(
            isinstance(want, int) and got != want for got, want in zip(value.shape, spec.shape)
        ):
            problems.append(f"{key}: shape {list(value.shape)}, expected {spec.describe()}")
    if problems:
        expected = ", ".join(f"{k} {s.describe()}" for k, s in inputs.items())
        raise RuntimeInputError(f"{name}: {'; '.join(problems)} (expects: {expected})")


_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}


class OnnxRuntimeRunner:
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

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(self.name, self.inputs, feeds)
        values = self.session.run(self.output_names, feeds)
        return dict(zip(self.output_names, values))


class TorchRunner:
    """The PyTorch reference: a module called with the same named inputs as the exported graph."""

    def __init__(self, module, inputs: dict[str, TensorSpec], output_names: Sequence[str], *, name: str):
        self.module, self.inputs, self.output_names, self.name = module, inputs, list(output_names), name

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        check_feeds(self.name, self.inputs, feeds)
        with torch.inference_mode():
            outputs = self.module(*[torch.from_numpy(np.ascontiguousarray(feeds[k])) for k in self.inputs])
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        return {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy()
                for k, v in zip(self.output_names, outputs)}


class CallableRunner:
    """Adapter for a plain function (tests, composite runners)."""

    def __init__(self, fn: Callable[[dict], dict], inputs: dict[str, TensorSpec], *, name: str):
        self.fn, self.inputs, self.name = fn, inputs, name

    def run(self, feeds):
        check_feeds(self.name, self.inputs, feeds)
        return self.fn(feeds)
