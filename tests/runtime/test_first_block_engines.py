"""First-block caching over built FLUX engines (onnxruntime): `first_block` / `rest_blocks` exported and checked
against PyTorch, the engine pipeline's cached images equal the cached torch reference's within the engines' own
parity, STEP_CACHE=off is the uncached engine, and parity judges the cached variant by its gate. Slow: a FLUX build."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.metrics import psnr
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ARGS = dict(prompt="a red fox in the snow", height=64, width=64, steps=6, guidance_scale=3.5, seed=1)


@pytest.fixture(scope="module")
def built_flux(tiny_model_factory, tmp_path_factory, write_engines_yaml):
    config = write_engines_yaml(tmp_path_factory.mktemp("first-block"), tiny_model_factory("flux"), "flux", cfg=["none"],
                                precision={"text_encoder": "fp32", "text_encoder_2": "fp32", "transformer": "fp32",
                                           "vae_decoder": "fp32"},
                                step_cache={"method": "first_block", "threshold": 0.6})
    report = api.build(config, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    return config


def test_cached_engines_reproduce_the_cached_reference(built_flux, tmp_path):
    config = load_engines_file(built_flux)
    model = config.models["flux-tiny"]
    model_dir, family, table = engine_runners(config, "flux-tiny", "onnxruntime")
    engines = EnginePipeline(model_dir, family, table, step_cache=model.step_cache)
    reference = EnginePipeline(model_dir, family, reference_runners(model_dir, family, step_cache=model.step_cache),
                               step_cache=model.step_cache)
    cached, expected = engines.generate(GenerationRequest(**ARGS)), reference.generate(GenerationRequest(**ARGS))
    assert cached.timings.step_schedule == expected.timings.step_schedule == "Fccccc"
    assert psnr(expected.images, cached.images) >= 40.0
    plain = EnginePipeline(model_dir, family, table)
    np.testing.assert_array_equal(engines.generate(GenerationRequest(**ARGS, step_cache="off")).images,
                                  plain.generate(GenerationRequest(**ARGS)).images)
    run = api.parity(built_flux, targets=["onnxruntime"], out_dir=tmp_path / "parity")
    variant = next(v for v in run.report.variants if v.step_cache)
    assert variant.passed and variant.step_cache == "first_block threshold 0.6"
    assert (variant.thresholds.min_psnr_db, variant.thresholds.min_ssim) == (30.0, 0.90)
