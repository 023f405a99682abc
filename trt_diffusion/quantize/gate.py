"""The quality gate a quantized denoiser must pass before it is published.

Held-out generations (prompts and seeds the calibration never saw) run twice through the real diffusers
pipeline with the same seeds:

1. with the pipeline's own fp32 torch denoiser, recording every denoiser call and its output: the reference;
2. with the Q/DQ ONNX model, run by ONNX Runtime on CPU, routed in place of the denoiser's forward.

Measured: the Q/DQ model's output on each recorded call against the fp32 output (PSNR with the reference's
range as peak, max abs difference, NaN/Inf), and the decoded images of run 2 against run 1 (PSNR, SSIM;
LPIPS when its weights are on disk). Per-call comparison isolates the denoiser; the images show what the
error does after the sampler compounds it over all steps. A video family's outputs are clips, judged as the
parity report judges them: by their worst frame's PSNR and SSIM (`metrics.video_metrics`) and by their motion
against the reference's own, on the same image bar. Where a pipeline has two denoisers (Wan 2.2's experts)
only the one being quantized is replaced; the other runs in fp32 in both runs. Both use the artifact the
engines will be built from, not torch fake-quantization (the two drift apart over many layers).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..errors import QuantizeError
from ..families import Component, Family
from ..memory import release_memory, return_large_blocks_to_os
from ..metrics import Thresholds, has_nonfinite, lpips_distance, psnr, ssim, tensor_diff, thresholds_for, video_metrics
from ..synthetic_world import parse_caption, prompt_grid
from .calibration import CalibrationRecipe, CallRecorder, denoiser_of, run_pipeline
from .defaults import DENOISER_MIN_PSNR_DB, HELD_OUT_SEED_OFFSET
from .feeds import DenoiserInterface, as_numpy
from .prompts import HELD_OUT_PROMPTS, take


@dataclass(frozen=True)
class GateThresholds:
    min_output_psnr_db: float  # worst held-out denoiser call
    image: Thresholds  # decoded images: the parity bar for the precision, engines.yaml `parity:` applied

    @classmethod
    def for_precision(cls, precision: str, parity_overrides: Mapping[str, Any] | None = None,
                      min_output_psnr_db: float | None = None) -> GateThresholds:
        if precision not in DENOISER_MIN_PSNR_DB:
            raise QuantizeError(f"no quantization gate for precision {precision!r}")
        overrides = {k: v for k, v in (parity_overrides or {}).items() if v is not None}
        bar = DENOISER_MIN_PSNR_DB[precision] if min_output_psnr_db is None else min_output_psnr_db
        return cls(bar, thresholds_for(precision, overrides))

    def to_json(self) -> dict:
        return {"min_output_psnr_db": self.min_output_psnr_db, "image": self.image.model_dump()}


@dataclass
class GateResult:
    precision: str
    thresholds: dict
    calls: int
    output_psnr_db_min: float
    output_psnr_db_mean: float
    output_max_abs: float
    output_nonfinite: int
    # per image: psnr_db, ssim, lpips, lpips_reason, nonfinite; per clip the same (its worst frames'), plus "video":
    # frames, worst_psnr_frame, worst_ssim_frame, mean_psnr_db, mean_ssim, motion_rmse, reference_motion,
    # motion_error
    images: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    outputs: dict[str, float] = field(default_factory=dict)  # a step-cache piece's worst PSNR per output (pieces.py)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def image_psnr_db_min(self) -> float | None:
        return min((i["psnr_db"] for i in self.images), default=None)

    @property
    def image_ssim_min(self) -> float | None:
        return min((i["ssim"] for i in self.images), default=None)

    def summary(self) -> str:
        text = (f"denoiser output vs fp32 over {self.calls} held-out calls: worst PSNR "
                f"{self.output_psnr_db_min:.2f} dB (mean {self.output_psnr_db_mean:.2f}), max abs "
                f"{self.output_max_abs:.4g}, non-finite {self.output_nonfinite}")
        if self.images:
            what = "clips (worst frame)" if "video" in self.images[0] else "images"
            text += (f"; {what}: worst PSNR {self.image_psnr_db_min:.2f} dB, worst SSIM "
                     f"{self.image_ssim_min:.4f}")
        return text

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed, "image_psnr_db_min": self.image_psnr_db_min,
                "image_ssim_min": self.image_ssim_min}


def held_out_recipe(recipe: CalibrationRecipe, samples: int) -> tuple[list[str], list[int]]:
    """Prompts and seeds disjoint from the calibration's: a synthetic-world calibration (all its prompts captions
    of that world) is judged on the evaluation grid's prompts, which it leaves out."""
    world = all(parse_caption(prompt) is not None for prompt in recipe.prompts)
    prompts = take(prompt_grid() if world else list(HELD_OUT_PROMPTS), samples)
    seeds = [recipe.seed + HELD_OUT_SEED_OFFSET + i for i in range(samples)]
    return prompts, seeds


def onnxruntime_session(onnx_path: Path):
    """ONNX Runtime on the Q/DQ graph as written: no graph optimizations, no memory arena.

    The gate judges the quantization by the ONNX's own semantics (each engine is judged again by parity, on
    its own runtime's fusions). It is also the memory-safe way: ORT's constant folding of the Q/DQ weights
    peaks at 2.3x the fp32 weights while the session is created on the full-size SDXL UNet (21.8 GiB, 0.9x
    on SD1.5), and the arena keeps the largest per-call weight dequantizations; unoptimized, the weights stay
    memory-mapped (1.2x in all). Calls are slower (SDXL 10 s against 4 s), session creation 100 s faster.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types; any of them means the artifact is unusable
        raise QuantizeError(f"ONNX Runtime cannot load {onnx_path}: {str(exc).strip().splitlines()[0]}") from None


def _run_session(session, interface: DenoiserInterface, call) -> np.ndarray:
    """The session's answer to one recorded call, in the layout the pipeline's denoiser returns."""
    output = session.run([interface.output_name], as_numpy(interface.feeds(call)))[0]
    return interface.pipeline_output(torch.from_numpy(output), call).numpy()


@contextmanager
def _onnx_denoiser(pipe, session, interface: DenoiserInterface):
    """Route the pipeline's denoiser calls to the ONNX Runtime session (the module only carries its config)."""
    module = denoiser_of(pipe, interface.component)

    def forward(*args, **kwargs):
        output = torch.from_numpy(_run_session(session, interface, (args, kwargs)))
        return (output,) if not kwargs.get("return_dict", True) else SimpleNamespace(sample=output)

    module.forward = forward
    try:
        yield
    finally:
        del module.forward


def release_weights(module: torch.nn.Module) -> None:
    """Drop a module's tensors, keep its config: once the fp32 reference is recorded, the Q/DQ session stands
    in for the denoiser, and a full-size model must not be held next to it. Each parameter and buffer becomes
    an empty tensor of its dtype and device, which is all the pipeline still reads from the module."""
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def run_gate(pipe, family: Family, interface: DenoiserInterface, onnx_path: Path, precision: str,
             recipe: CalibrationRecipe, thresholds: GateThresholds, held_out_samples: int,
             compare_images: bool = True, component: Component | None = None) -> GateResult:
    """Measure the artifact at `onnx_path` against `pipe`'s fp32 denoiser (`component`, default the pipeline's
    first) on held-out generations.

    The pipeline's denoiser is spent afterwards (its weights are released once the reference is recorded)."""
    prompts, seeds = held_out_recipe(recipe, held_out_samples)
    output_type = "np" if compare_images else "latent"
    recorder = CallRecorder(with_outputs=True)
    generate = {"max_sequence_length": recipe.max_sequence_length, "frames": recipe.frames, "component": component}
    reference_images = run_pipeline(pipe, family, prompts, seeds, recipe.steps, recipe.width, recipe.height,
                                     output_type=output_type, recorder=recorder, progress_stage="gate: PyTorch",
                                     **generate)
    if not recorder.calls:
        raise QuantizeError(f"the held-out generations never called the {interface.component.value}: nothing to "
                            f"gate (at {recipe.steps} steps, does it run any?)")
    release_weights(denoiser_of(pipe, component))
    release_memory()
    return_large_blocks_to_os()  # the session's per-call weight temporaries (memory.py says why)
    session = onnxruntime_session(onnx_path)

    outputs = [(expected.numpy(), _run_session(session, interface, call))
               for call, expected in zip(recorder.calls, recorder.outputs)]
    images = []
    if compare_images:
        with _onnx_denoiser(pipe, session, interface):
            candidate_images = run_pipeline(pipe, family, prompts, seeds, recipe.steps, recipe.width, recipe.height,
                                            output_type="np", progress_stage="gate: Q/DQ ONNX", **generate)
        images = [_compare(ref_image, image) for ref_image, image in zip(reference_images, candidate_images)]

    return judge_outputs(precision, thresholds, outputs, images)


def judge_outputs(precision: str, thresholds: GateThresholds, outputs: list[tuple[np.ndarray, np.ndarray]],
                  images: list[dict] | None = None) -> GateResult:
    """The gate's result over (reference, Q/DQ) output pairs, one per held-out call: PSNR over the reference's range
    (worst and mean), max |difference|, NaN/Inf; `images` (the decoded comparisons) judged beside them."""
    psnrs, max_abs, nonfinite = [], 0.0, 0
    for expected, actual in outputs:
        if has_nonfinite(actual):
            nonfinite += int((~np.isfinite(actual)).sum())
        diff = tensor_diff(expected, actual)
        peak = float(expected.max() - expected.min()) or 1.0
        psnrs.append(psnr(expected, actual, data_range=peak))
        if math.isfinite(diff.max_abs):
            max_abs = max(max_abs, diff.max_abs)
    result = GateResult(
        precision=precision, thresholds=thresholds.to_json(), calls=len(psnrs), output_psnr_db_min=worst_value(psnrs),
        output_psnr_db_mean=float(np.mean(psnrs)) if psnrs else math.nan, output_max_abs=max_abs,
        output_nonfinite=nonfinite, images=images or [],
    )
    result.failures = gate_failures(result, thresholds)
    return result


def _compare(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """One image's figures (pixels in [0, 1]); a clip [F, H, W, 3] as parity judges one: its worst frames' PSNR
    and SSIM, the LPIPS of its worst-PSNR frame, and its per-frame and motion figures under "video"."""
    nonfinite = bool(has_nonfinite(candidate))
    video = None
    if np.ndim(reference) == 4:
        figures = video_metrics(reference, candidate, data_range=1.0)
        psnr_db, ssim_value = figures.min_psnr_db, figures.min_ssim
        video = {"frames": figures.frames, "worst_psnr_frame": figures.worst_psnr_frame,
                 "worst_ssim_frame": figures.worst_ssim_frame, "mean_psnr_db": figures.mean_psnr_db,
                 "mean_ssim": figures.mean_ssim, "motion_rmse": figures.motion_rmse,
                 "reference_motion": figures.reference_motion, "motion_error": figures.motion_error}
        reference, candidate = reference[figures.worst_psnr_frame], candidate[figures.worst_psnr_frame]
    else:
        psnr_db, ssim_value = psnr(reference, candidate, data_range=1.0), ssim(reference, candidate, data_range=1.0)
    lp = lpips_distance(reference, candidate, data_range=1.0)
    figures_json = {"psnr_db": psnr_db, "ssim": ssim_value, "lpips": lp.value, "lpips_reason": lp.reason,
                    "nonfinite": nonfinite}
    return {**figures_json, "video": video} if video is not None else figures_json


def worst_value(values: list[float]) -> float:
    """The lowest value; NaN (a NaN output) wins, since min() ignores it depending on order."""
    if not values or any(math.isnan(v) for v in values):
        return math.nan
    return min(values)


def gate_failures(result: GateResult, thresholds: GateThresholds) -> list[str]:
    failures = []
    if result.output_nonfinite:
        failures.append(f"denoiser output has {result.output_nonfinite} NaN/Inf values")
    if not result.output_psnr_db_min >= thresholds.min_output_psnr_db:
        failures.append(f"denoiser output PSNR {result.output_psnr_db_min:.2f} dB < "
                        f"{thresholds.min_output_psnr_db:g} dB (worst of {result.calls} held-out calls)")
    for index, image in enumerate(result.images):
        video = image.get("video")
        label = f"video {index} (worst frames: PSNR {video['worst_psnr_frame']}, SSIM {video['worst_ssim_frame']})" \
            if video else f"image {index}"
        if image["nonfinite"]:
            failures.append(f"{label}: NaN/Inf pixels")
        whys = thresholds.image.image_failures(image["psnr_db"], image["ssim"], image["lpips"], image["lpips_reason"])
        if video:  # the same temporal bar the parity report applies (pixels in [0, 1] here)
            whys += thresholds.image.motion_failures(video["motion_rmse"], video["reference_motion"], data_range=1.0)
        failures += [f"{label}: {why}" for why in whys]
    return failures
