"""First-block caching in the FLUX loop: the reference pipeline over `first_block` / `rest_blocks` equals diffusers'
FluxPipeline with its FirstBlockCacheConfig hook, image for image, and STEP_CACHE=off the uncached pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.schedulers import make_scheduler
from trt_diffusion.step_cache import StepCache, StepCacheMethod

PROMPT = "a lighthouse on a cliff at dusk"
ARGS = dict(prompt=PROMPT, height=64, width=64, steps=6, guidance_scale=3.5, seed=5)


def diffusers_first_block(folder, threshold: float) -> np.ndarray:
    from diffusers import DiffusionPipeline, FirstBlockCacheConfig

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler("default", dict(pipe.scheduler.config), "flux")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    images = pipe(PROMPT, height=64, width=64, num_inference_steps=6, guidance_scale=3.5, max_sequence_length=32,
                  generator=torch.Generator().manual_seed(5), output_type="np").images
    return (images * 255).round().astype(np.uint8)


@pytest.mark.parametrize("threshold", [pytest.param(0.08, marks=pytest.mark.slow), 0.6])
def test_reference_first_block_cache_equals_diffusers(tiny_model_factory, threshold):
    folder = tiny_model_factory("flux")
    cache = StepCache(StepCacheMethod.first_block, threshold=threshold)
    pipeline = EnginePipeline(folder, "flux", reference_runners(folder, "flux", step_cache=cache), step_cache=cache)
    generation = pipeline.generate(GenerationRequest(**ARGS))
    assert generation.timings.step_schedule.startswith("F") and len(generation.timings.step_schedule) == 6
    np.testing.assert_array_equal(generation.images, diffusers_first_block(folder, threshold))
    off = pipeline.generate(GenerationRequest(**ARGS, step_cache="off"))
    assert off.timings.step_schedule == ""
    if threshold == 0.6:  # the tiny model's residual moves less than that after the first step: all cached
        assert generation.timings.step_schedule == "Fccccc"
        assert not np.array_equal(off.images, generation.images)
