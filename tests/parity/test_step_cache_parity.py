"""`parity` judges the step-cached engines against the uncached fp32 reference with the cache's own gate, shows the
step schedule, and diffs the cache's engines (unet_deep, unet_shallow) against their PyTorch graphs."""

from __future__ import annotations

import pytest
import yaml

from trt_diffusion import api


@pytest.mark.slow  # a parity run over the cached engines (~17 s); the runtime tests check them on every change
def test_the_cached_variant_is_judged_by_its_own_gate(built_sd15_step_cache, tmp_path):
    run = api.parity(built_sd15_step_cache, targets=["onnxruntime"], out_dir=tmp_path / "parity")
    variants = {v.variant_id: v for v in run.report.variants}
    plain, cached = variants["sd15-tiny/onnxruntime/64x64"], variants["sd15-tiny/onnxruntime/64x64/step-cache"]
    assert plain.step_cache is None and plain.passed
    assert cached.step_cache == "deepcache interval 3, branch 0" and cached.step_schedule == "FccF"  # 4 steps
    assert (cached.thresholds.min_psnr_db, cached.thresholds.min_ssim) == (24.0, 0.80) and cached.passed
    # the cache changed the images (judged against the uncached reference, they are not its copy)
    assert all(0 < image.psnr_db < 100 for image in cached.images)
    engines = {c.component for c in plain.components}
    assert {"sd15-tiny.unet_deep.64x64.b2.fp32", "sd15-tiny.unet_shallow.64x64.b2.fp32"} <= engines
    assert "step cache: deepcache interval 3, branch 0" in (tmp_path / "parity" / "parity.html").read_text()


@pytest.mark.slow
def test_a_gate_the_cached_images_miss_fails_the_variant(built_sd15_step_cache, tmp_path):
    document = yaml.safe_load(built_sd15_step_cache.read_text())
    document["models"]["sd15-tiny"]["step_cache"]["gate"] = {"min_psnr_db": 99.0}
    strict = built_sd15_step_cache.parent / "engines-strict.yaml"  # the same workspace: the same engines
    strict.write_text(yaml.safe_dump(document, sort_keys=False))
    run = api.parity(strict, targets=["onnxruntime"], out_dir=tmp_path / "parity")
    cached = next(v for v in run.report.variants if v.step_cache)
    assert not cached.passed and not run.report.passed
    assert any("PSNR" in reason for reason in cached.failure_reasons), cached.failure_reasons
