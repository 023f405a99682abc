"""Export-time parity: ONNX Runtime against the PyTorch module, same seeded inputs, several shapes.

The reference is always the fp32 module. An output passes when

    max |onnx - torch|  <=  atol + rtol × max |torch|        (the output's scale)

and, for image outputs (pixels in [-1, 1]), PSNR >= min_psnr_db. Any NaN/Inf in the ONNX output where
the reference is finite fails; in an fp16 graph it is reported as fp16 overflow (the classic fp16 VAE
failure: black or NaN images), as are values pinned at fp16's largest magnitude.

The PyTorch outputs can be computed first (`reference_outputs`) and the module freed before the ONNX
Runtime session opens: the export stage never holds the torch weights and the session's at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..components.base import ComponentDef, Geometry
from ..components.model_config import ModelConfig
from ..errors import ExportError
from ..metrics import psnr, tensor_diff
from ..precision import Precision

FP16_MAX = 65504.0
IMAGE_DATA_RANGE = 2.0  # decoder pixels span [-1, 1]


@dataclass(frozen=True)
class Tolerance:
    rtol: float  # allowed max abs error as a fraction of the output's scale (max |reference|)
    atol: float  # floor, for outputs whose scale is close to zero
    min_psnr_db: float  # image outputs only

    def allowed(self, scale: float) -> float:
        return self.atol + self.rtol * scale


# fp32: kernels differ only in summation order (observed <= 3e-6 relative on every tiny component).
# fp16 is compared with the fp32 module, so the bar includes fp16's own rounding: PyTorch's fp16 FLUX is
# 2.7% off its fp32 self on the tiny model. 5% still fails any wrong weight or wiring (errors of the
# output's own size); image quality in fp16 is judged later by the parity stage (PSNR/SSIM of images).
TOLERANCES: Mapping[str, Tolerance] = {
    Precision.fp32: Tolerance(rtol=1e-3, atol=1e-5, min_psnr_db=60.0),
    Precision.fp16: Tolerance(rtol=5e-2, atol=1e-3, min_psnr_db=35.0),
    # bf16 graphs are checked as `widened_for_parity` copies (ONNX Runtime has no bf16 kernels on CPU): bf16
    # weights in fp32 math, so the bar is bf16's weight rounding (8 mantissa bits: 0.4% per weight); a wrong
    # weight or wiring is still an error of the output's own size. bf16 activations are tested in
    # tests/export/test_bf16_export.py against torch's bf16 module.
    Precision.bf16: Tolerance(rtol=8e-2, atol=2e-3, min_psnr_db=30.0),
}


@dataclass(frozen=True)
class OutputParity:
    output: str
    geometry: str
    shape: tuple[int, ...]
    max_abs: float
    mean_abs: float
    max_rel: float  # max_abs / max |reference|
    allowed_abs: float
    psnr_db: float | None  # image outputs; None elsewhere, and when identical (infinite PSNR)
    nan_count: int
    inf_count: int
    saturated_count: int
    problem: str | None  # why it failed; None when it passed

    @property
    def passed(self) -> bool:
        return self.problem is None

    def to_json(self) -> dict:
        data = asdict(self)
        data["shape"] = list(self.shape)
        data["passed"] = self.passed
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in data.items()}


def open_session(onnx_path: Path, label: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # A correctness check, not a speed run: no prepacked second copy of every MatMul weight and no arena keeping
    # the largest activations after they are freed (a 1.3B Wan transformer at 7,800 tokens: weights twice plus
    # two 2.9 GB attention score tensors held went past 24 GB)
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = False
    # nor one block planned for every activation of a run (the memory pattern): each is allocated when produced and
    # freed when last read (the mid-size Qwen-Image encoder at 2 x 512 tokens: run peak 0.60 -> 0.57 GB)
    options.enable_mem_pattern = False
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types
        raise ExportError(f"{label}: ONNX Runtime cannot load {onnx_path}: {str(exc).splitlines()[0]}") from exc


def reference_outputs(reference: torch.nn.Module, definition: ComponentDef, config: ModelConfig,
                      options: Mapping[str, Any], geometries: Sequence[Geometry],
                      seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The fp32 module's outputs at every geometry, on the seeded inputs `check_parity` feeds ONNX Runtime."""
    io = definition.io(config, options)
    return [run_reference(reference, definition.dummy_inputs(config, options, geometry, seed), io.input_names,
                          io.output_names) for geometry in geometries]


def check_parity(onnx_path: Path, reference: torch.nn.Module | Sequence[Mapping[str, np.ndarray]],
                 definition: ComponentDef, config: ModelConfig, options: Mapping[str, Any],
                 geometries: Sequence[Geometry], precision: str, label: str, seed: int = 0) -> list[OutputParity]:
    """Compare at every geometry; ExportError listing every failing output when any fails.

    `reference` is the PyTorch module, or its outputs from `reference_outputs` (same geometries and seed).
    """
    tolerance = TOLERANCES[precision]
    io = definition.io(config, options)
    if isinstance(reference, torch.nn.Module):
        reference = reference_outputs(reference, definition, config, options, geometries, seed)
    if len(reference) != len(geometries):
        raise ValueError(f"{label}: {len(reference)} reference outputs for {len(geometries)} geometries")
    if precision == Precision.bf16:
        from .bf16 import widened_for_parity

        with widened_for_parity(onnx_path) as widened:
            session = open_session(widened, label)
    else:
        session = open_session(onnx_path, label)
    records = []
    for geometry, expected in zip(geometries, reference):
        feeds = definition.dummy_inputs(config, options, geometry, seed)
        try:
            got = dict(zip(io.output_names, session.run(io.output_names, feeds)))
        except Exception as exc:
            raise ExportError(f"{label}: ONNX Runtime failed at {geometry.label()}: {str(exc).splitlines()[0]}") from exc
        for name in io.output_names:
            records.append(compare_output(name, geometry, expected[name], got[name], tolerance, precision,
                                          image=name in io.image_outputs))
    failures = [r for r in records if not r.passed]
    if failures:
        lines = "\n  ".join(f"output '{r.output}' at {r.geometry} (shape {list(r.shape)}): {r.problem}" for r in failures)
        raise ExportError(f"{label}: the exported ONNX does not match PyTorch "
                          f"({len(failures)} of {len(records)} checks failed):\n  {lines}")
    return records


def run_reference(reference: torch.nn.Module, feeds: Mapping[str, np.ndarray], input_names: Sequence[str],
                  output_names: Sequence[str]) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        outputs = reference(*[torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in input_names])
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    return {name: value.float().numpy() for name, value in zip(output_names, outputs)}


def compare_output(name: str, geometry: Geometry, expected: np.ndarray, got: np.ndarray, tolerance: Tolerance,
                   precision: str, image: bool = False) -> OutputParity:
    if expected.shape != got.shape:
        return OutputParity(name, geometry.label(), tuple(expected.shape), math.nan, math.nan, math.nan, math.nan,
                            None, 0, 0, 0, f"shape {list(got.shape)}, PyTorch gives {list(expected.shape)}")
    diff = tensor_diff(expected, got)
    scale = float(np.abs(expected[np.isfinite(expected)]).max()) if np.isfinite(expected).any() else 0.0
    allowed = tolerance.allowed(scale)
    saturated = int((np.abs(got) >= FP16_MAX).sum()) if precision == Precision.fp16 else 0
    psnr_db = psnr(expected, got, data_range=IMAGE_DATA_RANGE) if image and diff.is_finite else None
    problem = None
    if not np.isfinite(expected).all():
        problem = "PyTorch's own fp32 output has NaN/Inf at this shape: the model itself is broken"
    elif not diff.is_finite or saturated:
        counts = f"{diff.nan_count} NaN, {diff.inf_count} Inf, {saturated} at ±{FP16_MAX:g}"
        if precision == Precision.fp16:
            problem = (f"float16 overflow ({counts} values; PyTorch fp32 is finite, max |value| {scale:.4g}): this "
                       f"component cannot run in fp16 — set its precision to fp32 in engines.yaml")
        else:
            problem = f"non-finite output ({counts} values) where PyTorch is finite"
    elif not diff.max_abs <= allowed:  # `not <=` so NaN fails too
        problem = (f"max abs error {diff.max_abs:.3g} > allowed {allowed:.3g} "
                   f"({tolerance.atol:g} + {tolerance.rtol:g} × output scale {scale:.4g})")
    elif psnr_db is not None and not psnr_db >= tolerance.min_psnr_db:
        problem = f"PSNR {psnr_db:.1f} dB < {tolerance.min_psnr_db:g} dB"
    return OutputParity(
        output=name, geometry=geometry.label(), shape=tuple(expected.shape), max_abs=diff.max_abs,
        mean_abs=diff.mean_abs, max_rel=diff.max_rel, allowed_abs=allowed,
        psnr_db=psnr_db if psnr_db is None or math.isfinite(psnr_db) else None,
        nan_count=diff.nan_count, inf_count=diff.inf_count, saturated_count=saturated, problem=problem,
    )
