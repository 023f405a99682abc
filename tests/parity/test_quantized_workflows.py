"""Quantized denoisers serve the image workflows too, gated: an int8 and an fp8 sd15 UNet (ModelOpt, calibrated on
the txt2img pipeline, gated at quantize) built for onnxruntime, then `parity` judges txt2img, img2img and inpaint
against the fp32 torch reference, each with the precision's own gate.

Measured on the tiny random-weight UNet (4 steps, strength 0.6: two kept steps): int8 passes every workflow
(PSNR 27-36 dB); fp8 passes txt2img (26-30 dB) but not img2img/inpaint (19-25 dB, SSIM 0.70-0.93 against its
0.8 floor). At strength 1.0 both workflows are as good as txt2img, so the loss is the short low-noise schedule's
sensitivity, not the image path. The gate is not tuned for it: an fp8 release with image workflows is blocked
until its own parity passes."""

from __future__ import annotations

import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _parity(tiny_sd15_dir, write_engines_yaml, tmp_path, precision):
    config = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", workflows=["txt2img", "img2img", "inpaint"],
                                precision={"text_encoder": "fp32", "unet": precision, "vae_decoder": "fp32"})
    report = api.build(config, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    run = run_parity(load_engines_file(config, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a lighthouse at dusk",), seeds=(0,), compute_lpips=False))
    by_workflow = {v.workflow: v for v in run.report.variants}
    assert set(by_workflow) == {"txt2img", "img2img", "inpaint"}
    assert {v.precision for v in by_workflow.values()} == {precision}
    return run.report, by_workflow


def test_an_int8_unet_passes_every_workflow(tiny_sd15_dir, write_engines_yaml, tmp_path):
    report, by_workflow = _parity(tiny_sd15_dir, write_engines_yaml, tmp_path, "int8")
    for variant in by_workflow.values():
        assert variant.passed, (variant.workflow, variant.failure_reasons)
    assert report.passed


def test_an_fp8_unet_is_judged_per_workflow(tiny_sd15_dir, write_engines_yaml, tmp_path):
    report, by_workflow = _parity(tiny_sd15_dir, write_engines_yaml, tmp_path, "fp8")
    assert by_workflow["txt2img"].passed, by_workflow["txt2img"].failure_reasons
    for variant in by_workflow.values():  # each image judged against fp8's own bar, verdicts consistent
        assert variant.thresholds == by_workflow["txt2img"].thresholds
        assert variant.passed == all(image.passed for image in variant.images) == (not variant.failure_reasons)
    assert report.passed == all(v.passed for v in by_workflow.values())
