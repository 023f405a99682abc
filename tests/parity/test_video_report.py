"""The parity report of a video variant, from synthetic clips [F, H, W, 3] (no model): per-frame and motion
figures, the gate on the worst frame and the motion, the frame strips, looped previews and the HTML showing them."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from html.parser import HTMLParser
from urllib.parse import unquote

import numpy as np
import pytest
from PIL import Image

from trt_diffusion.metrics import thresholds_for
from trt_diffusion.parity.report import compare_image, judge_report, judge_variant, read_report, write_report
from trt_diffusion.parity.report.files import STRIP_GAP, frame_strip, strip_frames

FRAMES, HEIGHT, WIDTH = 17, 24, 32  # 4k + 1 frames, as Wan makes them


def _clip() -> np.ndarray:
    """A gradient drifting two pixels a frame."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    return np.stack([np.stack([(x + 2 * t) * 7 % 256, y * 9, (x + y + t) * 4 % 256], axis=-1)
                     for t in range(FRAMES)]).astype(np.uint8)


def _noisy(pixels: np.ndarray, amplitude: int, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).integers(-amplitude, amplitude + 1, pixels.shape)
    return np.clip(pixels.astype(np.int64) + noise, 0, 255).astype(np.uint8)


@pytest.fixture
def clips() -> dict[str, np.ndarray]:
    reference = _clip()
    corrupted = _noisy(reference, 1)
    corrupted[9] = _noisy(reference[9], 90, seed=1)  # one broken frame
    return {"ref.png": reference, "good.png": _noisy(reference, 1), "bad.png": corrupted}


def _variant(variant_id: str, clips, candidate_png: str):
    thresholds = thresholds_for("fp16")
    comparison = compare_image(prompt="a boat <drifting>", seed=0, reference=clips["ref.png"],
                               candidate=clips[candidate_png], thresholds=thresholds, reference_png="ref.png",
                               candidate_png=candidate_png, compute_lpips=False)
    return judge_variant(variant_id=variant_id, model="wan21-tiny", target="onnxruntime", precision="fp16",
                         bucket=f"{WIDTH}x{HEIGHT}x{FRAMES}", thresholds=thresholds, images=[comparison])


@pytest.fixture
def report(clips):
    return judge_report([_variant("wan/good", clips, "good.png"), _variant("wan/bad", clips, "bad.png")],
                        tool_versions={"python": "3.11"}, created_at=datetime(2026, 1, 2, tzinfo=UTC))


def test_a_clip_comparison_records_its_frames_and_gates_the_worst(report):
    good, bad = report.variants
    assert good.passed and good.images[0].video.frames == FRAMES
    video = bad.images[0].video
    assert not bad.passed and video.worst_psnr_frame == video.worst_ssim_frame == 9
    assert bad.images[0].psnr_db == video.psnr_db[9] < video.mean_psnr_db  # the gated figure is the worst frame's
    assert video.mean_ssim > bad.images[0].ssim
    (reason,) = bad.failure_reasons
    assert reason.startswith("video 0 (seed 0, 'a boat <drifting>'; worst frames: PSNR 9, SSIM 9): PSNR ")
    assert "dB < 30 dB" in reason and "SSIM" in reason


def test_the_gate_judges_motion_too():
    # pairs of frames swapped: every frame is close to its own, but the motion runs back and forth
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    wave = np.stack([128 + 40 * np.sin(2 * np.pi * (x + y / 2 - t) / 32) for t in range(FRAMES)])
    reference = np.repeat(np.rint(wave)[..., None], 3, axis=-1).astype(np.uint8)  # ~5.5 levels RMS of motion
    order = np.arange(FRAMES - 1).reshape(-1, 2)[:, ::-1].ravel().tolist() + [FRAMES - 1]
    bar = thresholds_for("fp16")  # 30 dB: a frame may be 8.06 levels RMS off
    comparison = compare_image(prompt="p", seed=0, reference=reference, candidate=reference[order], thresholds=bar,
                               reference_png="r.png", candidate_png="c.png", compute_lpips=False)
    assert bar.image_failures(comparison.psnr_db, comparison.ssim, None) == []
    assert not comparison.passed and comparison.video.motion_error > 1
    assert bar.motion_failures(comparison.video.motion_rmse, comparison.video.reference_motion) != []


def test_lpips_is_measured_on_the_worst_frame(clips, monkeypatch):
    from trt_diffusion.metrics import LpipsResult
    from trt_diffusion.parity.report import judge

    seen = []
    monkeypatch.setattr(judge, "lpips_distance", lambda r, c: seen.append((r, c)) or LpipsResult(value=0.5))
    compare_image(prompt="p", seed=0, reference=clips["ref.png"], candidate=clips["bad.png"],
                  thresholds=thresholds_for("fp16"), reference_png="ref.png", candidate_png="bad.png")
    ((reference, candidate),) = seen
    np.testing.assert_array_equal(reference, clips["ref.png"][9])
    np.testing.assert_array_equal(candidate, clips["bad.png"][9])


def test_write_report_writes_strips_previews_and_heatmaps(report, clips, tmp_path):
    files = write_report(report, clips, tmp_path)
    assert sorted(p.name for p in files.images) == ["bad.png", "good.png", "ref.png"]
    assert sorted(p.name for p in files.previews) == ["bad.webp", "good.webp", "ref.webp"]
    assert sorted(p.name for p in files.heatmaps) == ["bad.diff.png", "good.diff.png"]
    shown = strip_frames(FRAMES)
    assert shown == [0, 3, 6, 9, 12, 15]  # every 3rd frame: at most 8
    strip = np.asarray(Image.open(tmp_path / "ref.png"))
    assert strip.shape == (HEIGHT, len(shown) * WIDTH + (len(shown) - 1) * STRIP_GAP, 3)
    np.testing.assert_array_equal(strip, frame_strip(clips["ref.png"]))
    np.testing.assert_array_equal(strip[:, WIDTH + STRIP_GAP:2 * WIDTH + STRIP_GAP], clips["ref.png"][3])
    assert np.asarray(Image.open(tmp_path / "bad.diff.png")).shape == strip.shape
    with Image.open(tmp_path / "bad.webp") as preview:
        assert (preview.format, preview.n_frames, preview.size) == ("WEBP", FRAMES, (WIDTH, HEIGHT))
        assert preview.info["loop"] == 0  # loops forever
        preview.seek(9)
        preview.load()  # a WebP frame reads its timing as it loads
        assert preview.info["duration"] == 62  # 16 fps


def test_json_round_trips_the_video_figures(report, clips, tmp_path):
    files = write_report(report, clips, tmp_path)
    raw = json.loads(files.json.read_text(), parse_constant=lambda token: pytest.fail(f"bare {token} in JSON"))
    video = raw["variants"][1]["images"][0]["video"]
    assert video["reference_preview"] == "ref.webp" and video["candidate_preview"] == "bad.webp"
    assert video["strip_frames"] == [0, 3, 6, 9, 12, 15] and len(video["psnr_db"]) == FRAMES
    assert "VideoComparison" in json.loads(files.schema.read_text())["$defs"]
    loaded = read_report(files.json)
    assert loaded.variants[1].images[0].video.worst_psnr_frame == 9
    assert loaded.variants[0].images[0].video.psnr_db[0] == pytest.approx(report.variants[0].images[0].video.psnr_db[0])
    assert not math.isnan(loaded.variants[0].images[0].video.motion_error)


class _Figures(HTMLParser):
    def __init__(self):
        super().__init__()
        self.figures: list[tuple[str, str]] = []  # (class, img src)
        self._class = ""

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "figure":
            self._class = attributes.get("class") or ""
        elif tag == "img":
            self.figures.append((self._class, unquote(attributes["src"])))


def test_html_shows_the_previews_side_by_side_and_the_strips_below(report, clips, tmp_path):
    files = write_report(report, clips, tmp_path)
    text = files.html.read_text()
    page = _Figures()
    page.feed(text)
    bad = page.figures[len(page.figures) // 2:]
    assert bad == [("", "ref.webp"), ("", "bad.webp"), ("strip", "ref.png"), ("strip", "bad.png"),
                   ("strip", "bad.diff.png")]
    for _, src in page.figures:
        assert (tmp_path / src).is_file(), src
    assert ".grid .strip { grid-column: 1 / -1; }" in text
    assert "frames 0, 3, 6, 9, 12, 15" in text and "(frame 9)" in text
    assert "a boat &lt;drifting&gt;" in text
    assert '<ul class="failures"><li>video 0 (seed 0, ' in text


def test_clips_must_match_their_comparison(report, clips, tmp_path):
    still = dict(clips, **{"bad.png": clips["bad.png"][0]})
    with pytest.raises(ValueError, match=r"a video comparison of 17 frames needs two clips"):
        write_report(report, still, tmp_path)
    image = compare_image(prompt="p", seed=0, reference=clips["ref.png"][0], candidate=clips["good.png"][0],
                          thresholds=thresholds_for("fp16"), reference_png="ref.png", candidate_png="good.png",
                          compute_lpips=False)
    variant = judge_variant(variant_id="v", model="m", target="onnxruntime", precision="fp16", bucket="b",
                            thresholds=thresholds_for("fp16"), images=[image])
    with pytest.raises(ValueError, match="no video figures"):
        write_report(judge_report([variant], tool_versions={}), clips, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_image_comparison_is_written_as_before(clips):
    image = compare_image(prompt="p", seed=0, reference=clips["ref.png"][0], candidate=clips["good.png"][0],
                          thresholds=thresholds_for("fp16"), reference_png="ref.png", candidate_png="good.png",
                          compute_lpips=False)
    assert image.video is None and "video" not in json.loads(image.model_dump_json())
