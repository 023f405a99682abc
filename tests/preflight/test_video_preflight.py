"""The pre-launch checklist on a Wan video model, in process (issue 24): every check that applies runs on clips at
the bucket's frames and passes; the quality baseline stores clips losslessly (frames one under another) and the
next run compares against them; the report shows clips as frame strips. Slow: it runs on the tiny Wan engines of
the session's `built_wan`."""

from __future__ import annotations

import pytest
from PIL import Image

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.preflight.run import run_preflight

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_preflight_passes_on_a_video_model(built_wan, tmp_path):
    config = load_engines_file(built_wan("split"))
    saved = run_preflight(config, save_baseline=True, in_process=True, target="onnxruntime", out_dir=tmp_path / "a")
    assert saved.baseline is not None
    stored = next(saved.baseline.glob("*.png"))
    with Image.open(stored) as image:  # 5 frames of 32x32, one under another
        assert image.size == (32, 5 * 32)
    run = run_preflight(config, in_process=True, target="onnxruntime", out_dir=tmp_path / "b")
    status = {check.name: check.status for check in run.report.checks}
    assert status["quality"] == "pass" and status["reproducibility"] == "pass", status
    assert all(s in ("pass", "n/a") for s in status.values()), status
    quality = next(c for c in run.report.checks if c.name == "quality")
    row = quality.rows[0]
    assert row["psnr_db"] == float("inf")  # the same engines: the same clips
    with Image.open(tmp_path / "b" / row["image"]) as strip:  # the report's clip: a frame strip
        assert strip.size[1] == 32 and strip.size[0] > 32
