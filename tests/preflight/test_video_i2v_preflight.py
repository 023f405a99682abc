"""The pre-launch checklist on a Wan image-to-video model (issue 24). An I2V checkpoint serves img2vid alone, so
every request of the checks carries the seeded first frame at the bucket's size, the checks that are not about
workflows (buckets, memory, cancellation, overload) included: in process every check that applies passes, the
baseline holds img2vid clips and the report shows the first frame beside each clip; packaged and served, the
first request timed at start is an img2vid request too. Slow: it builds the tiny Wan 2.1 I2V engines and starts a
tritonserver."""

from __future__ import annotations

import pytest
from PIL import Image

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.preflight.run import run_preflight

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SIZE, FRAMES = 32, 5  # built_wan_i2v's i2v bucket


def test_preflight_passes_on_an_i2v_model_in_process(built_wan_i2v, tmp_path):
    config = load_engines_file(built_wan_i2v("i2v"))
    saved = run_preflight(config, save_baseline=True, in_process=True, target="onnxruntime", out_dir=tmp_path / "a")
    assert saved.baseline is not None
    with Image.open(next(saved.baseline.glob("*.png"))) as stored:  # 5 frames of 32x32, one under another
        assert stored.size == (SIZE, FRAMES * SIZE)
    run = run_preflight(config, in_process=True, target="onnxruntime", out_dir=tmp_path / "b")
    status = {check.name: check.status for check in run.report.checks}
    assert all(s in ("pass", "n/a") for s in status.values()), {c.name: c.failures for c in run.report.checks}
    assert status["quality"] == "pass" and status["reproducibility"] == "pass" and status["buckets"] == "pass"
    checks = {check.name: check for check in run.report.checks}
    assert {row["workflow"] for row in checks["reproducibility"].rows} == {"img2vid"}
    rows = checks["quality"].rows
    assert rows and all(r["workflow"] == "img2vid" and r["psnr_db"] == float("inf") for r in rows)  # same clips
    row = rows[0]
    with Image.open(tmp_path / "b" / row["input"]) as first_frame:  # the seeded first frame, at the bucket's size
        assert first_frame.size == (SIZE, SIZE)
    with Image.open(tmp_path / "b" / row["image"]) as strip:  # the clip: a frame strip
        assert strip.size[1] == SIZE and strip.size[0] > SIZE


def test_served_preflight_times_an_img2vid_first_request(built_wan_i2v, tmp_path):
    config = load_engines_file(built_wan_i2v("i2v"))
    run = run_preflight(config, only=["buckets", "reproducibility"], target="onnxruntime", out_dir=tmp_path)
    checks = {check.name: check for check in run.report.checks}
    assert all(c.status == "pass" for c in checks.values()), {n: c.failures for n, c in checks.items()}
    (bucket,) = checks["buckets"].rows
    # timed by start_served before any other request: a txt2img request would have been refused
    assert bucket["timed_at"].startswith("start") and bucket["first_request_s"] > 0
