"""A refit LoRA covers DeepCache's two engines: the refitted unet_deep / unet_shallow (whose refit maps list the UNet
weights a piece never reads as unused, left out instead of refused) give the image of the cached torch reference
with the LoRA fused, pixel for pixel. Slow: a refittable build."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion import api
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.export.modules import fuse_lora
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_refit_lora_reaches_both_cached_engines(tiny_sd15_dir, tmp_path, write_engines_yaml):
    lora_file = tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"
    path = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15",
                              precision={"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"},
                              loras={"style": {"source": str(lora_file), "mode": "refit"}},
                              step_cache={"method": "deepcache", "interval": 3, "branch": 0})
    report = api.build(path, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    config = load_engines_file(path)
    cache = config.models["sd15-tiny"].step_cache
    model_dir, family, refitted = engine_runners(config, "sd15-tiny", "onnxruntime", loras=[(lora_file, 1.0)])
    _, _, plain = engine_runners(config, "sd15-tiny", "onnxruntime")
    reference = reference_runners(model_dir, family, step_cache=cache)
    fuse_lora(next(e for e in reference.entries if e.component == "unet").runner.module.model, "style", lora_file,
              1.0, "unet")
    request = GenerationRequest(prompt="a red fox", height=64, width=64, steps=6, guidance_scale=5.0, seed=1)
    with_lora = EnginePipeline(model_dir, family, refitted, step_cache=cache).generate(request)
    assert with_lora.timings.step_schedule == "FccFcc"
    expected = EnginePipeline(model_dir, family, reference, step_cache=cache).generate(request).images
    assert np.abs(with_lora.images.astype(int) - expected.astype(int)).max() <= 1
    without = EnginePipeline(model_dir, family, plain, step_cache=cache).generate(request).images
    assert not np.array_equal(without, with_lora.images)
