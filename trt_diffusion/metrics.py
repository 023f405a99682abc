"""Image, video and tensor metrics for same-seed parity, and the thresholds that gate them.

PSNR and SSIM always work offline. LPIPS is optional: it needs the `lpips` package *and* the
AlexNet backbone weights in the torch hub cache, and this module never downloads anything, so
without them `lpips_distance` returns a value of None with the reason.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trt_diffusion.errors import ConfigError
from trt_diffusion.precision import Precision

# The file torchvision's AlexNet_Weights.IMAGENET1K_V1 is cached as; lpips uses this backbone.
ALEXNET_WEIGHTS_FILE = "alexnet-owt-7be5be79.pth"

_REL_EPSILON = 1e-12  # keeps max_rel finite when the reference is all zeros
_SSIM_DEFAULT_WIN = 7  # skimage's default window; smaller images get the largest odd window that fits


# --- PSNR / SSIM -----------------------------------------------------------------------------


def _as_float_pair(reference: Any, candidate: Any) -> tuple[np.ndarray, np.ndarray]:
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if ref.shape != cand.shape:
        raise ValueError(f"shape mismatch: reference {ref.shape} vs candidate {cand.shape}")
    if ref.size == 0:
        raise ValueError("cannot compare empty arrays")
    return ref, cand


def psnr(reference: Any, candidate: Any, data_range: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB; inf when the images are identical, nan if the candidate has NaN.

    `data_range` is the span of valid pixel values: 255 for uint8 images, 1.0 for floats in [0, 1].
    """
    ref, cand = _as_float_pair(reference, candidate)
    mse = float(np.mean((ref - cand) ** 2))
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(data_range**2 / mse)


def _ssim_window(height: int, width: int) -> int:
    side = min(height, width, _SSIM_DEFAULT_WIN)
    window = side if side % 2 == 1 else side - 1
    if window < 3:
        raise ValueError(f"SSIM needs images of at least 3x3 pixels, got {height}x{width}")
    return window


def ssim(reference: Any, candidate: Any, data_range: float = 255.0) -> float:
    """Structural similarity (1.0 = identical) of HxW or HxWxC images.

    Uses scikit-image with a 7x7 window, or the largest odd window (>= 3) that fits a smaller image.
    """
    from skimage.metrics import structural_similarity  # deferred: skimage's import is slow

    ref, cand = _as_float_pair(reference, candidate)
    if ref.ndim not in (2, 3):
        raise ValueError(f"SSIM expects HxW or HxWxC images, got shape {ref.shape}")
    window = _ssim_window(ref.shape[0], ref.shape[1])
    channel_axis = -1 if ref.ndim == 3 else None
    value = structural_similarity(ref, cand, win_size=window, data_range=data_range, channel_axis=channel_axis)
    return float(value)


# --- video clips -----------------------------------------------------------------------------

# The temporal gate: a clip's frame-to-frame changes may be off by at most this fraction of the reference's own
# changes (a frozen clip scores 1.0, a reversed or shuffled one more), or by what one frame at the PSNR bar may be.
MAX_MOTION_ERROR = 0.5


@dataclass(frozen=True)
class VideoMetrics:
    """How far a candidate clip [F, H, W, C] is from its reference, frame by frame and in its motion.

    Per frame: PSNR and SSIM, their worst frame and their mean. `mean_psnr_db` is the PSNR of the frames' mean
    squared error (the clip's PSNR over all its pixels), not the mean of the dB values: one identical frame
    (inf dB) would make that mean inf whatever the other frames are.

    Motion: the frame-to-frame differences D = diff(clip, axis=0) of both clips, `motion_rmse` = RMS(Dc - Dr) and
    `reference_motion` = RMS(Dr), in pixel levels. The error is judged against the reference's own motion
    (`motion_error` = their ratio) and not as a PSNR of Dc against Dr over a data range of 510: since
    (a - b)^2 <= 2a^2 + 2b^2, that PSNR is never below the worst frame's PSNR, so it cannot fail a clip whose
    frames all pass. Motion is small beside the pixel range: a clip whose frames are frozen, reversed,
    shuffled or flickering can keep every frame within a PSNR bar while its motion is wrong by as much as the
    motion itself, which this ratio shows (frozen: 1.0). A one-frame clip has no motion (both 0).
    """

    psnr_db: tuple[float, ...]
    ssim: tuple[float, ...]
    motion_rmse: float
    reference_motion: float
    data_range: float = 255.0

    @property
    def frames(self) -> int:
        return len(self.psnr_db)

    @property
    def worst_psnr_frame(self) -> int:
        return _worst_index(self.psnr_db)

    @property
    def worst_ssim_frame(self) -> int:
        return _worst_index(self.ssim)

    @property
    def min_psnr_db(self) -> float:
        return self.psnr_db[self.worst_psnr_frame]

    @property
    def min_ssim(self) -> float:
        return self.ssim[self.worst_ssim_frame]

    @property
    def mean_psnr_db(self) -> float:
        mse = float(np.mean([self.data_range**2 / 10 ** (value / 10) for value in self.psnr_db]))  # inf dB -> 0
        return math.inf if mse == 0.0 else 10.0 * math.log10(self.data_range**2 / mse)

    @property
    def mean_ssim(self) -> float:
        return float(np.mean(self.ssim))

    @property
    def motion_error(self) -> float:
        """motion_rmse / reference_motion: 0 = the reference's motion exactly, 1.0 = as wrong as a frozen clip."""
        if self.reference_motion == 0.0:
            return 0.0 if self.motion_rmse == 0.0 else math.inf
        return self.motion_rmse / self.reference_motion

    def to_json(self) -> str:
        """Every figure, derived ones included; inf and NaN as the strings "Infinity" and "NaN" (the reports'
        convention: plain JSON has no such numbers)."""
        figures = {name: getattr(self, name) for name in (
            "frames", "psnr_db", "ssim", "worst_psnr_frame", "worst_ssim_frame", "min_psnr_db", "min_ssim",
            "mean_psnr_db", "mean_ssim", "motion_rmse", "reference_motion", "motion_error", "data_range")}
        return json.dumps(_finite_json(figures), sort_keys=True)


def _worst_index(values: tuple[float, ...]) -> int:
    """The lowest value's index; a NaN counts as worst of all (a broken frame)."""
    nan = [i for i, value in enumerate(values) if math.isnan(value)]
    return nan[0] if nan else int(np.argmin(values))


def _finite_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(item) for item in value]
    return value


def video_metrics(reference: Any, candidate: Any, data_range: float = 255.0) -> VideoMetrics:
    """Per-frame PSNR/SSIM and the motion error of two same-shaped clips [F, H, W, C] (or [F, H, W])."""
    ref, cand = _as_float_pair(reference, candidate)
    if ref.ndim not in (3, 4):
        raise ValueError(f"a clip is [frames, height, width(, channels)], got shape {ref.shape}")
    if len(ref) > 1:
        reference_steps = np.diff(ref, axis=0)
        motion_rmse = math.sqrt(float(np.mean((np.diff(cand, axis=0) - reference_steps) ** 2)))
        reference_motion = math.sqrt(float(np.mean(reference_steps**2)))
    else:
        motion_rmse = reference_motion = 0.0
    return VideoMetrics(
        psnr_db=tuple(psnr(r, c, data_range) for r, c in zip(ref, cand)),
        ssim=tuple(ssim(r, c, data_range) for r, c in zip(ref, cand)),
        motion_rmse=motion_rmse, reference_motion=reference_motion, data_range=data_range)


# --- LPIPS (optional) ------------------------------------------------------------------------


@dataclass(frozen=True)
class LpipsResult:
    """An LPIPS distance (0 = identical, lower is better), or None and why it was not computed."""

    value: float | None
    reason: str | None = None


def torch_hub_dir() -> Path:
    """torch.hub.get_dir() without importing torch when it is not loaded yet (importing it is slow)."""
    if "torch" in sys.modules:
        import torch.hub

        return Path(torch.hub.get_dir())
    torch_home = os.environ.get("TORCH_HOME")
    if torch_home:
        return Path(torch_home).expanduser() / "hub"
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(cache_home).expanduser() / "torch" / "hub"


def alexnet_weights_path(hub_dir: Path | None = None) -> Path:
    """Where torchvision caches the AlexNet backbone that LPIPS uses."""
    return (hub_dir or torch_hub_dir()) / "checkpoints" / ALEXNET_WEIGHTS_FILE


def _lpips_unavailable_reason(weights: Path) -> str | None:
    if not weights.is_file():
        return (
            f"LPIPS not computed: AlexNet backbone weights not found in {weights.parent}; "
            "install `lpips` and run once with network access"
        )
    try:
        import lpips  # noqa: F401  (optional dependency)
    except Exception as error:  # noqa: BLE001 - lpips also fails when torchvision does not import beside torch
        return f"LPIPS not computed: the optional `lpips` package does not import ({error}); pip install lpips"
    return None


def _load_alexnet_backbone(model: Any, weights: Path) -> None:
    """Copy torchvision AlexNet `features.N.*` weights into lpips' `net.sliceK.N.*` modules."""
    import torch

    state = torch.load(weights, map_location="cpu", weights_only=True)
    layers = {}
    for name, module in model.net.named_modules():
        parts = name.split(".")
        if len(parts) == 2 and parts[0].startswith("slice"):
            layers[parts[1]] = module
    loaded = 0
    for key, tensor in state.items():
        parts = key.split(".")  # features.<index>.<weight|bias>
        if len(parts) == 3 and parts[0] == "features" and parts[1] in layers:
            getattr(layers[parts[1]], parts[2]).data.copy_(tensor)
            loaded += 1
    if loaded == 0:
        raise ValueError(f"{weights} holds no AlexNet `features.*` weights")


@functools.lru_cache(maxsize=2)
def _lpips_model(weights: Path) -> Any:
    import lpips

    # pnet_rand=True builds the backbone without torchvision's download; the real weights are
    # then copied in from the cache. The linear heads ship inside the lpips package.
    model = lpips.LPIPS(net="alex", pretrained=True, pnet_rand=True, verbose=False)
    _load_alexnet_backbone(model, weights)
    return model.eval()


def _to_lpips_tensor(image: np.ndarray, data_range: float) -> Any:
    import torch

    pixels = np.asarray(image, dtype=np.float32) / float(data_range)  # [0, 1]
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[..., None], 3, axis=-1)
    return torch.from_numpy(pixels * 2.0 - 1.0).permute(2, 0, 1).unsqueeze(0)  # NCHW in [-1, 1]


def lpips_distance(
    reference: Any, candidate: Any, data_range: float = 255.0, hub_dir: Path | None = None
) -> LpipsResult:
    """LPIPS (AlexNet) distance of two HxWx3 images, computed only from weights already on disk.

    Never downloads: when the backbone weights are not in the torch hub cache (or `lpips` does not
    import) the result has value None and a reason to show in the report.
    """
    ref, cand = _as_float_pair(reference, candidate)
    weights = alexnet_weights_path(hub_dir)
    reason = _lpips_unavailable_reason(weights)
    if reason:
        return LpipsResult(value=None, reason=reason)
    import torch

    try:
        model = _lpips_model(weights)
        with torch.no_grad():
            value = model(_to_lpips_tensor(ref, data_range), _to_lpips_tensor(cand, data_range))
    except Exception as error:  # noqa: BLE001 - a corrupt cache file or an lpips API change: report, don't crash parity
        return LpipsResult(value=None, reason=f"LPIPS not computed: loading or running it failed ({error})")
    return LpipsResult(value=float(value.reshape(-1)[0]))


# --- tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorDiff:
    """How far a candidate tensor is from its reference.

    max_abs, mean_abs and max_rel are over the positions where both tensors are finite (nan when
    there are none); nan_count and inf_count count the candidate's non-finite values, which a
    parity gate must treat as a failure on their own.
    """

    shape: tuple[int, ...]
    max_abs: float
    mean_abs: float
    max_rel: float  # max_abs / max(|reference|), with a tiny epsilon against division by zero
    nan_count: int
    inf_count: int

    @property
    def is_finite(self) -> bool:
        return self.nan_count == 0 and self.inf_count == 0


def has_nonfinite(array: Any) -> bool:
    """True when the array holds any NaN or +-inf (integer arrays never do)."""
    values = np.asarray(array)
    if not np.issubdtype(values.dtype, np.inexact):
        return False
    return not bool(np.isfinite(values).all())


def tensor_diff(reference: np.ndarray, candidate: np.ndarray) -> TensorDiff:
    """Absolute and relative differences of two same-shaped tensors (computed in float64)."""
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if ref.shape != cand.shape:
        raise ValueError(f"tensor shape mismatch: reference {ref.shape} vs candidate {cand.shape}")
    both_finite = np.isfinite(ref) & np.isfinite(cand)
    abs_diff = np.abs(ref - cand)[both_finite]
    if abs_diff.size:
        max_abs, mean_abs = float(abs_diff.max()), float(abs_diff.mean())
        ref_scale = float(np.abs(ref[both_finite]).max())
    else:
        max_abs = mean_abs = ref_scale = math.nan
    return TensorDiff(
        shape=tuple(int(d) for d in ref.shape),
        max_abs=max_abs,
        mean_abs=mean_abs,
        max_rel=max_abs / max(ref_scale, _REL_EPSILON) if abs_diff.size else math.nan,
        nan_count=int(np.isnan(cand).sum()),
        inf_count=int(np.isinf(cand).sum()),
    )


# --- thresholds ------------------------------------------------------------------------------


class Thresholds(BaseModel):
    """The pass bar for one variant's images. max_lpips None: LPIPS is reported but not gated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_psnr_db: float = Field(ge=0, allow_inf_nan=False)
    min_ssim: float = Field(ge=-1, le=1)
    max_lpips: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    def merged(self, overrides: Mapping[str, Any] | None) -> Thresholds:
        """A copy with `overrides` (e.g. engines.yaml's `parity:` block) applied; unknown keys are an error."""
        if not overrides:
            return self
        unknown = sorted(set(overrides) - set(type(self).model_fields))
        if unknown:
            allowed = ", ".join(type(self).model_fields)
            raise ConfigError(f"unknown parity threshold(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
        try:
            return type(self).model_validate({**self.model_dump(), **dict(overrides)})
        except ValidationError as error:
            raise ConfigError(f"invalid parity thresholds {dict(overrides)}: {error}") from error

    def image_failures(
        self, psnr_db: float, ssim_value: float, lpips: float | None, lpips_reason: str | None = None
    ) -> list[str]:
        """Why an image misses this bar (empty when it passes). `not (x >= bar)` so NaN fails too."""
        failures = []
        if not psnr_db >= self.min_psnr_db:
            failures.append(f"PSNR {psnr_db:.2f} dB < {self.min_psnr_db:g} dB")
        if not ssim_value >= self.min_ssim:
            failures.append(f"SSIM {ssim_value:.4f} < {self.min_ssim:g}")
        if self.max_lpips is not None:
            if lpips is None:
                failures.append(f"LPIPS gate (max {self.max_lpips:g}) set but {lpips_reason or 'LPIPS not computed'}")
            elif not lpips <= self.max_lpips:
                failures.append(f"LPIPS {lpips:.4f} > {self.max_lpips:g}")
        return failures

    def motion_failures(self, motion_rmse: float, reference_motion: float, data_range: float = 255.0) -> list[str]:
        """Why a clip's motion misses this bar (see VideoMetrics): its frame-to-frame changes may be off by
        MAX_MOTION_ERROR of the reference's own, or by the RMS error a frame at min_psnr_db has, whichever is
        larger (motion smaller than the error a frame may have is not judged). NaN fails."""
        frame_rms = data_range * 10 ** (-self.min_psnr_db / 20)
        allowed = max(MAX_MOTION_ERROR * reference_motion, frame_rms)
        if motion_rmse <= allowed:
            return []
        return [f"motion off by {motion_rmse:.2f} RMS per frame step > {allowed:.2f} allowed (the larger of "
                f"{MAX_MOTION_ERROR:g} x the reference's {reference_motion:.2f} and the {frame_rms:.2f} a frame at "
                f"{self.min_psnr_db:g} dB may be off)"]


# Same-seed image parity bars per engine precision. Quantized engines (fp8/int8) drift further
# from the fp32 reference, so they get looser bars; engines.yaml `parity:` overrides per variant.
DEFAULT_THRESHOLDS: Mapping[str, Thresholds] = MappingProxyType(
    {
        Precision.fp32: Thresholds(min_psnr_db=40.0, min_ssim=0.98),
        Precision.fp16: Thresholds(min_psnr_db=30.0, min_ssim=0.95),
        Precision.bf16: Thresholds(min_psnr_db=30.0, min_ssim=0.95),
        Precision.fp8: Thresholds(min_psnr_db=20.0, min_ssim=0.80),
        Precision.int8: Thresholds(min_psnr_db=20.0, min_ssim=0.80),
    }
)


def thresholds_for(precision: str, overrides: Mapping[str, Any] | None = None) -> Thresholds:
    """The default bar for `precision`, with engines.yaml overrides applied."""
    try:
        base = DEFAULT_THRESHOLDS[str(getattr(precision, "value", precision))]
    except KeyError:
        known = ", ".join(DEFAULT_THRESHOLDS)
        raise ConfigError(f"no parity thresholds for precision {precision!r}; known: {known}") from None
    return base.merged(overrides)
