"""torch -> ONNX with the dynamo exporter.

`dynamo=True, optimize=False`: every parameter keeps its name as an initializer (refit maps by name),
peak memory stays near the model's size, and one external-data file is written. Dynamic axes are
`torch.export.Dim`s: one root per axis (batch, latent height, latent width, tokens, latent frames), every
symbolic dim a multiple of its root (plus its offset), so downsampled sizes (UNet residuals, pixels) stay exact
expressions.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Mapping
from io import StringIO
from pathlib import Path

import numpy as np
import torch

from ..components.base import ComponentIO, SymbolicDim
from ..errors import ExportError
from .shapes import ExportShapes

log = logging.getLogger(__name__)


def dynamic_shapes(io: ComponentIO, shapes: ExportShapes) -> tuple[dict[int, object], ...]:
    """Per input (in order): axis index -> torch.export Dim (or a multiple of one)."""
    from torch.export import Dim

    roots: dict[str, tuple[object, int]] = {}

    def root(axis: str):
        if axis not in roots:  # only axes the graph uses: an unused one may have an empty range
            low, high = shapes.ranges[axis]
            unit = shapes.alignment if axis in ("height", "width") else 1  # the alignment is spatial
            roots[axis] = (Dim(f"{axis}_units" if unit > 1 else axis, min=low // unit, max=high // unit), unit)
        return roots[axis]

    def expression(dim: SymbolicDim):
        base, unit = root(dim.axis)
        multiple = dim.scale * unit
        if multiple.denominator != 1:
            raise ExportError(f"dim {dim.name} ({dim.scale} × {dim.axis}) is not a whole multiple of the "
                              f"export's alignment {unit}")
        scaled = base if multiple == 1 else int(multiple) * base
        return scaled + dim.offset if dim.offset else scaled

    specs = []
    for decl in io.inputs:
        specs.append({axis: expression(d) for axis, d in enumerate(decl.dims) if isinstance(d, SymbolicDim)})
    return tuple(specs)


def export_module(wrapper: torch.nn.Module, example: Mapping[str, np.ndarray], io: ComponentIO, shapes: ExportShapes,
                  opset: int, out_path: Path, label: str, legacy: bool = False) -> None:
    """Trace `wrapper` on `example` and write `out_path` (+ `<name>.data`) with the declared I/O names.
    `legacy`: the TorchScript tracer, for a graph whose every dim is fixed (the trace bakes Python values in)."""
    args = tuple(torch.from_numpy(np.ascontiguousarray(example[name])) for name in io.input_names)
    quiet = QuietExporter()
    try:
        if legacy:
            if any(not isinstance(d, int) for t in (*io.inputs, *io.outputs) for d in t.dims):
                raise ExportError(f"{label}: a legacy trace needs every dim fixed, {io.inputs} are not")
            with quiet, torch.inference_mode(False), torch.no_grad():
                torch.onnx.export(wrapper, args, str(out_path), dynamo=False, opset_version=opset,
                                  input_names=io.input_names, output_names=io.output_names, verbose=False)
            return
        with quiet, torch.inference_mode(False), torch.no_grad():
            program = torch.onnx.export(
                wrapper, args, dynamo=True, optimize=False, opset_version=opset, external_data=True,
                input_names=io.input_names, output_names=io.output_names,
                dynamic_shapes=(dynamic_shapes(io, shapes),),  # forward(*inputs): one entry, the varargs tuple
                verbose=False,
            )
            program.save(str(out_path), external_data=True)
    except ExportError:
        raise
    except Exception as exc:  # torch.export / onnxscript errors: the model does not export as declared
        log.debug("exporter output for %s:\n%s", label, quiet.text())
        raise ExportError(f"{label}: torch.onnx.export failed: {_summary(exc)} (run with --debug for details)") from exc
    finally:
        drop_trace_state()


def drop_trace_state() -> None:
    """Free the traced graph torch.export leaves behind. torch's proxy_tensor keeps a module-level map from fake
    tensors to the FX nodes of the last trace (cleared when the next trace starts, not when this one ends): it
    held a whole exported graph — ~0.2 GB of FX nodes, fake tensors and sympy expressions for a 0.5 GB language
    model — through the graph passes and the ONNX Runtime check, the export's peak."""
    from torch.fx.experimental import proxy_tensor

    held = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(held, dict):
        held.clear()


class QuietExporter(contextlib.AbstractContextManager):
    """Keep the exporter's progress lines (printed to stdout) out of the user's terminal."""

    def __init__(self):
        self._buffer = StringIO()
        self._redirect = contextlib.redirect_stdout(self._buffer)
        self._levels: dict[str, int] = {}

    def __enter__(self):
        for name in ("torch.onnx", "torch.export", "torch._dynamo", "torch.__trace", "onnxscript", "onnx_ir"):
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(logging.ERROR)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")  # deprecations and axis-renaming notes inside torch.onnx
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc_info):
        self._redirect.__exit__(*exc_info)
        self._warnings.__exit__(*exc_info)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        return False

    def text(self) -> str:
        return self._buffer.getvalue()


def _summary(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("#", "-", "(Refer", "For more information"))]
    text = (useful or lines or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {text[:400]}"
