"""PSNR, SSIM, LPIPS (offline behaviour), video clips, tensor diffs and thresholds."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest
from pydantic import ValidationError

from trt_diffusion import metrics
from trt_diffusion.errors import ConfigError
from trt_diffusion.metrics import (
    ALEXNET_WEIGHTS_FILE,
    DEFAULT_THRESHOLDS,
    MAX_MOTION_ERROR,
    Thresholds,
    has_nonfinite,
    lpips_distance,
    psnr,
    ssim,
    tensor_diff,
    thresholds_for,
    video_metrics,
)


def _noisy(image: np.ndarray, amplitude: int, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).integers(-amplitude, amplitude + 1, image.shape)
    return np.clip(image.astype(np.int64) + noise, 0, 255).astype(np.uint8)


@pytest.fixture
def image() -> np.ndarray:
    return np.random.default_rng(42).integers(0, 256, (32, 24, 3), dtype=np.uint8)


# --- PSNR ------------------------------------------------------------------------------------


def test_psnr_of_identical_images_is_inf(image):
    assert psnr(image, image.copy()) == math.inf


def test_psnr_of_constant_offset_matches_formula():
    reference = np.full((8, 8, 3), 100, dtype=np.uint8)
    candidate = reference + np.uint8(10)
    assert psnr(reference, candidate) == pytest.approx(20 * math.log10(255 / 10), rel=1e-12)  # 28.13 dB


def test_psnr_uses_data_range_for_float_images():
    reference = np.zeros((4, 4, 3))
    assert psnr(reference, reference + 0.1, data_range=1.0) == pytest.approx(20.0, rel=1e-12)


def test_psnr_does_not_wrap_uint8_subtraction():
    # uint8 arithmetic would give 0 - 10 = 246; the error must be 10, not 246.
    reference = np.zeros((4, 4), dtype=np.uint8)
    assert psnr(reference, reference + np.uint8(10)) == pytest.approx(20 * math.log10(25.5), rel=1e-12)


def test_psnr_is_nan_when_candidate_has_nan():
    reference = np.zeros((4, 4))
    candidate = reference.copy()
    candidate[1, 1] = np.nan
    assert math.isnan(psnr(reference, candidate))


def test_psnr_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\(4, 4, 3\).*\(4, 5, 3\)"):
        psnr(np.zeros((4, 4, 3)), np.zeros((4, 5, 3)))


# --- SSIM ------------------------------------------------------------------------------------


def test_ssim_of_identical_images_is_one(image):
    assert ssim(image, image.copy()) == pytest.approx(1.0, abs=1e-12)


def test_ssim_drops_with_more_noise():
    # A smooth gradient: noise destroys its structure (random pixels would hide it).
    y, x = np.mgrid[0:32, 0:24]
    smooth = np.stack([x * 8, y * 6, (x + y) * 4], axis=-1).astype(np.uint8)
    light, heavy = ssim(smooth, _noisy(smooth, 8)), ssim(smooth, _noisy(smooth, 64))
    assert 0.9 < light < 0.99
    assert heavy < 0.5


def test_ssim_fits_its_window_to_small_images():
    reference = np.random.default_rng(1).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    assert ssim(reference, reference) == pytest.approx(1.0, abs=1e-12)
    assert ssim(reference, _noisy(reference, 40)) < 0.99


def test_ssim_window_choice():
    assert metrics._ssim_window(512, 512) == 7
    assert metrics._ssim_window(6, 40) == 5
    assert metrics._ssim_window(3, 3) == 3
    with pytest.raises(ValueError, match="at least 3x3"):
        metrics._ssim_window(2, 8)


def test_ssim_of_grayscale_images():
    reference = np.random.default_rng(2).integers(0, 256, (16, 16), dtype=np.uint8)
    assert ssim(reference, reference) == pytest.approx(1.0, abs=1e-12)


# --- video clips -----------------------------------------------------------------------------


def _wave_clip(frames: int = 12, amplitude: float = 40.0, step: float = 1.0) -> np.ndarray:
    """A low-contrast wave drifting `step` pixels a frame: neighbouring frames are close, motion is small."""
    y, x = np.mgrid[0:24, 0:32]
    clip = [128 + amplitude * np.sin(2 * np.pi * (x + y / 2 - t * step) / 32) for t in range(frames)]
    return np.repeat(np.rint(np.stack(clip))[..., None], 3, axis=-1).astype(np.uint8)


def test_identical_clips_are_perfect():
    clip = _wave_clip()
    video = video_metrics(clip, clip.copy())
    assert video.frames == 12 and video.psnr_db == (math.inf,) * 12
    assert video.min_psnr_db == video.mean_psnr_db == math.inf
    assert video.min_ssim == pytest.approx(1.0) and video.mean_ssim == pytest.approx(1.0)
    assert video.motion_rmse == 0.0 and video.motion_error == 0.0 and video.reference_motion > 0


def test_the_worst_frame_is_the_corrupted_one():
    clip = _wave_clip()
    candidate = _noisy(clip, 2)
    candidate[7] = _noisy(clip[7], 50, seed=1)
    video = video_metrics(clip, candidate)
    assert video.worst_psnr_frame == video.worst_ssim_frame == 7
    assert video.min_psnr_db == video.psnr_db[7] < video.mean_psnr_db < min(video.psnr_db[:7])
    assert video.min_ssim == video.ssim[7] < video.mean_ssim


def test_mean_psnr_is_the_clips_psnr_and_stays_finite_beside_an_identical_frame():
    clip = np.zeros((2, 8, 8, 3), np.uint8)
    candidate = clip.copy()
    candidate[1] += 10  # frame 0 identical (inf dB), frame 1 off by 10 everywhere
    video = video_metrics(clip, candidate)
    assert video.psnr_db[0] == math.inf
    assert video.mean_psnr_db == pytest.approx(psnr(clip, candidate)) == pytest.approx(20 * math.log10(255 / 10)
                                                                                       + 10 * math.log10(2))


def test_shuffled_frames_keep_their_frame_scores_but_not_their_motion():
    clip = _wave_clip(frames=16, amplitude=4.0)
    shuffled = clip[np.random.default_rng(3).permutation(16)]
    video = video_metrics(clip, shuffled)
    assert video.mean_psnr_db > 35 and video.mean_ssim > 0.95  # each frame looks like a frame of the clip
    assert video.min_psnr_db > 30  # even the worst: within the fp16 bar
    assert video.motion_error > 1  # its motion is further off than a frozen clip's would be


def test_swapped_frames_pass_the_frame_bar_and_fail_the_motion_bar():
    bar = thresholds_for("fp16")  # 30 dB: a frame may be 8.06 levels RMS off
    clip = _wave_clip(frames=16, amplitude=40.0)  # ~5.5 levels RMS of motion per frame step
    swapped = clip.reshape(8, 2, *clip.shape[1:])[:, ::-1].reshape(clip.shape)  # 1 0 3 2 5 4 ...
    video = video_metrics(clip, swapped)
    assert bar.image_failures(video.min_psnr_db, video.min_ssim, None) == []
    assert bar.motion_failures(video.motion_rmse, video.reference_motion) != []


def test_frozen_clip_scores_one():
    clip = _wave_clip()
    video = video_metrics(clip, np.repeat(clip[:1], len(clip), axis=0))
    assert video.motion_error == pytest.approx(1.0)


def test_one_frame_has_no_motion_and_shapes_are_checked():
    frame = _wave_clip(frames=1)
    assert video_metrics(frame, _noisy(frame, 5)).motion_error == 0.0
    with pytest.raises(ValueError, match="a clip is"):
        video_metrics(frame[0, 0], frame[0, 0])
    with pytest.raises(ValueError, match="shape mismatch"):
        video_metrics(frame, _wave_clip(frames=2))


def test_motion_error_of_a_still_reference():
    still = np.full((3, 8, 8, 3), 90, np.uint8)
    moving = still.copy()
    moving[1] += 1
    assert video_metrics(still, still).motion_error == 0.0
    assert video_metrics(still, moving).motion_error == math.inf


def test_video_metrics_to_json_writes_inf_as_a_string():
    clip = _wave_clip(frames=3)
    candidate = clip.copy()
    candidate[2] = _noisy(clip[2], 20)
    video = video_metrics(clip, candidate)
    data = json.loads(video.to_json(), parse_constant=lambda token: pytest.fail(f"bare {token} in JSON"))
    assert data["psnr_db"][:2] == ["Infinity", "Infinity"] and data["worst_psnr_frame"] == 2
    assert data["frames"] == 3 and data["min_psnr_db"] == pytest.approx(video.psnr_db[2])
    assert data["motion_error"] == pytest.approx(video.motion_error)


def test_motion_failures():
    bar = Thresholds(min_psnr_db=40, min_ssim=0.98)  # a frame may be 2.55 levels RMS off
    assert bar.motion_failures(0.0, 0.0) == []
    assert bar.motion_failures(2.5, 0.0) == []  # below the error a frame may have: not judged
    assert bar.motion_failures(MAX_MOTION_ERROR * 10, 10.0) == []
    (failure,) = bar.motion_failures(6.0, 10.0)
    assert failure.startswith("motion off by 6.00 RMS per frame step > 5.00 allowed")
    assert bar.motion_failures(math.nan, 10.0) != []


# --- LPIPS -----------------------------------------------------------------------------------


def test_lpips_is_not_computed_without_backbone_weights(image, tmp_path):
    result = lpips_distance(image, image, hub_dir=tmp_path)
    assert result.value is None
    assert result.reason == (
        f"LPIPS not computed: AlexNet backbone weights not found in {tmp_path / 'checkpoints'}; "
        "install `lpips` and run once with network access"
    )


def test_lpips_default_location_follows_torch_home(image, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    result = lpips_distance(image, image)
    assert result.value is None
    assert str(tmp_path / "hub" / "checkpoints") in result.reason


def test_lpips_reports_missing_package_when_weights_exist(image, tmp_path, monkeypatch):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ALEXNET_WEIGHTS_FILE).write_bytes(b"not really weights")
    monkeypatch.setitem(sys.modules, "lpips", None)  # makes `import lpips` raise ImportError
    result = lpips_distance(image, image, hub_dir=tmp_path)
    assert result.value is None
    assert "`lpips` package does not import" in result.reason


def _fake_lpips_module(torch) -> types.ModuleType:
    """Mimics lpips.LPIPS's layout: net.slice1 holds AlexNet's features.0 (conv) and features.1 (relu)."""

    class FakeBackbone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.slice1 = torch.nn.Sequential()
            self.slice1.add_module("0", torch.nn.Conv2d(3, 2, kernel_size=1))
            self.slice1.add_module("1", torch.nn.ReLU())

    class LPIPS(torch.nn.Module):
        def __init__(self, net, pretrained, pnet_rand, verbose):
            super().__init__()
            assert pnet_rand, "the backbone must be built without torchvision's download"
            self.net = FakeBackbone()
            torch.nn.init.zeros_(self.net.slice1[0].weight)

        def forward(self, a, b):
            return (self.net.slice1(a) - self.net.slice1(b)).abs().mean().reshape(1, 1, 1, 1)

    module = types.ModuleType("lpips")
    module.LPIPS = LPIPS
    return module


def test_lpips_call_contract_with_a_stand_in_module(tmp_path, monkeypatch):
    """A check of the call contract only, not of LPIPS: real LPIPS needs the AlexNet backbone weights, which
    cannot be had offline (torchvision downloads them at first use). A stand-in `lpips` module with LPIPS's layout checks what our side
    does: LPIPS built without torchvision's download (pnet_rand), the cached backbone checkpoint's
    `features.*` weights loaded into its slices (others ignored), uint8 images mapped to [-1, 1], the
    distance read back as a float."""
    torch = pytest.importorskip("torch")
    checkpoint = {
        "features.0.weight": torch.ones(2, 3, 1, 1),
        "features.0.bias": torch.zeros(2),
        "classifier.1.weight": torch.ones(4, 4),  # not part of the LPIPS trunk: ignored
    }
    (tmp_path / "checkpoints").mkdir()
    torch.save(checkpoint, tmp_path / "checkpoints" / ALEXNET_WEIGHTS_FILE)
    monkeypatch.setitem(sys.modules, "lpips", _fake_lpips_module(torch))
    metrics._lpips_model.cache_clear()
    try:
        reference = np.zeros((4, 4, 3), dtype=np.uint8)
        candidate = np.full((4, 4, 3), 255, dtype=np.uint8)
        same = lpips_distance(reference, reference, hub_dir=tmp_path)
        different = lpips_distance(reference, candidate, hub_dir=tmp_path)
    finally:
        metrics._lpips_model.cache_clear()
    assert same.value == 0.0 and same.reason is None
    # Images map to [-1, 1]; with all-ones 1x1 kernels each conv output is relu(sum of 3 channels):
    # 0 for the black image, 3 for the white one. Zero weights (not loaded) would give 0.
    assert different.value == pytest.approx(3.0)


# --- tensors ---------------------------------------------------------------------------------


def test_tensor_diff_numbers():
    diff = tensor_diff(np.array([1.0, -2.0, 4.0]), np.array([1.5, -2.0, 3.0]))
    assert diff.shape == (3,)
    assert diff.max_abs == pytest.approx(1.0)
    assert diff.mean_abs == pytest.approx(0.5)
    assert diff.max_rel == pytest.approx(0.25)  # 1.0 / max|ref| = 1 / 4
    assert (diff.nan_count, diff.inf_count) == (0, 0)
    assert diff.is_finite


def test_tensor_diff_counts_nonfinite_candidate_values():
    reference = np.zeros((2, 3), dtype=np.float32)
    candidate = np.array([[np.nan, 1.0, np.inf], [-np.inf, np.nan, 0.5]], dtype=np.float32)
    diff = tensor_diff(reference, candidate)
    assert (diff.nan_count, diff.inf_count) == (2, 2)
    assert not diff.is_finite
    assert diff.max_abs == pytest.approx(1.0)  # over the finite positions only
    assert diff.mean_abs == pytest.approx(0.75)


def test_tensor_diff_relative_to_zero_reference_stays_finite():
    diff = tensor_diff(np.zeros(4), np.array([0.0, 0.0, 0.0, 1e-6]))
    assert math.isfinite(diff.max_rel) and diff.max_rel > 1e3


def test_tensor_diff_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"reference \(2, 3\) vs candidate \(3, 2\)"):
        tensor_diff(np.zeros((2, 3)), np.zeros((3, 2)))


def test_has_nonfinite():
    assert has_nonfinite(np.array([0.0, np.nan]))
    assert has_nonfinite(np.array([[np.inf]], dtype=np.float16))
    assert has_nonfinite(np.array([-np.inf]))
    assert not has_nonfinite(np.array([0.0, 1e30, -1e30]))
    assert not has_nonfinite(np.array([1, 2, 3], dtype=np.int64))


# --- thresholds ------------------------------------------------------------------------------


def test_default_thresholds_per_precision():
    table = {name: (t.min_psnr_db, t.min_ssim, t.max_lpips) for name, t in DEFAULT_THRESHOLDS.items()}
    assert table == {
        "fp32": (40.0, 0.98, None),
        "fp16": (30.0, 0.95, None),
        "bf16": (30.0, 0.95, None),
        "fp8": (20.0, 0.80, None),
        "int8": (20.0, 0.80, None),
    }


def test_default_thresholds_are_frozen():
    with pytest.raises(TypeError):
        DEFAULT_THRESHOLDS["fp16"] = Thresholds(min_psnr_db=1, min_ssim=0)  # type: ignore[index]
    with pytest.raises(ValidationError):
        DEFAULT_THRESHOLDS["fp16"].min_psnr_db = 1.0  # type: ignore[misc]


def test_thresholds_merged_overrides_only_given_fields():
    base = DEFAULT_THRESHOLDS["fp8"]
    merged = base.merged({"min_psnr_db": 30, "max_lpips": 0.2})
    assert (merged.min_psnr_db, merged.min_ssim, merged.max_lpips) == (30.0, 0.80, 0.2)
    assert base.min_psnr_db == 20.0  # the table is untouched
    assert base.merged({}) == base and base.merged(None) == base


def test_thresholds_merged_rejects_unknown_and_invalid_values():
    with pytest.raises(ConfigError, match="unknown parity threshold.*'min_psnr'.*allowed: min_psnr_db"):
        DEFAULT_THRESHOLDS["fp16"].merged({"min_psnr": 30})
    with pytest.raises(ConfigError, match="invalid parity thresholds"):
        DEFAULT_THRESHOLDS["fp16"].merged({"min_ssim": 2.0})


def test_thresholds_for_precision():
    assert thresholds_for("int8", {"min_ssim": 0.9}) == Thresholds(min_psnr_db=20, min_ssim=0.9)
    with pytest.raises(ConfigError, match="no parity thresholds for precision 'fp4'"):
        thresholds_for("fp4")


def test_image_failures():
    bar = Thresholds(min_psnr_db=30, min_ssim=0.95, max_lpips=0.1)
    assert bar.image_failures(math.inf, 1.0, 0.0) == []
    assert bar.image_failures(29.5, 0.96, 0.05) == ["PSNR 29.50 dB < 30 dB"]
    assert bar.image_failures(35, 0.9, 0.2) == ["SSIM 0.9000 < 0.95", "LPIPS 0.2000 > 0.1"]
    assert len(bar.image_failures(math.nan, math.nan, 0.0)) == 2  # NaN never passes
    assert bar.image_failures(35, 0.99, None, "LPIPS not computed: no weights") == [
        "LPIPS gate (max 0.1) set but LPIPS not computed: no weights"
    ]
    assert Thresholds(min_psnr_db=30, min_ssim=0.95).image_failures(35, 0.99, None) == []
