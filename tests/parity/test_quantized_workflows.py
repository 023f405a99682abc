"""Quantized denoisers serve the image workflows too: an int8 and an fp8 sd15 UNet (ModelOpt, calibrated on the
txt2img pipeline, gated at quantize) built for onnxruntime, then `parity` judges img2img and inpaint against
the fp32 torch reference with the precision's own gate."""

from __future__ import annotations

import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_unet_passes_every_workflow(tiny_sd15_dir, write_engines_yaml, tmp_path, precision):
    config = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", workflows=["txt2img", "img2img", "inpaint"],
                                precision={"text_encoder": "fp32", "unet": precision, "vae_decoder": "fp32"})
    report = api.build(config, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    run = run_parity(load_engines_file(config, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("a lighthouse at dusk",), seeds=(0,), compute_lpips=False))
    by_workflow = {v.workflow: v for v in run.report.variants}
    assert set(by_workflow) == {"txt2img", "img2img", "inpaint"}
    for variant in by_workflow.values():
        assert variant.precision == precision
        assert variant.passed, (variant.workflow, variant.failure_reasons)
