"""FLUX.1 Kontext edit through engines: the transformer built with twice the bucket's image tokens (the init
image's beside the noise), onnxruntime, judged by `parity` against the torch reference."""

from __future__ import annotations

import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_kontext_edit_engines_pass_parity(tiny_model_factory, write_engines_yaml, tmp_path):
    config = write_engines_yaml(tmp_path, tiny_model_factory("flux", variant="kontext"), "flux",
                                precision={"text_encoder": "fp32", "text_encoder_2": "fp32", "transformer": "fp32",
                                           "vae_decoder": "fp32"})
    report = api.build(config, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    run = run_parity(load_engines_file(config, check_sources=True), tmp_path / "parity",
                     ParityOptions(prompts=("make it night",), seeds=(0,), compute_lpips=False))
    (variant,) = run.report.variants
    assert variant.workflow == "edit" and variant.passed, variant.failure_reasons
