"""The step-cached pipeline: its schedule of full and cached steps equals the DeepCache package on diffusers' own
pipeline (torch reference, bit for bit), the engines reproduce that reference, STEP_CACHE=off is the uncached
pipeline, and requests with different schedules batch apart (batched equals single)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.metrics import psnr
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.schedulers import make_scheduler
from trt_diffusion.step_cache import StepCache, StepCacheMethod

DeepCache = pytest.importorskip("DeepCache")

PROMPT = "a lighthouse on a cliff at dusk"
CACHE = StepCache(StepCacheMethod.deepcache, interval=3, branch=0)
ARGS = dict(prompt=PROMPT, height=64, width=64, steps=7, guidance_scale=5.0, seed=3)


def diffusers_deepcache(folder, interval: int, branch: int, steps: int, seed: int, family: str = "sd15") -> np.ndarray:
    from DeepCache import DeepCacheSDHelper
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler("default", dict(pipe.scheduler.config), family)
    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=interval, cache_branch_id=branch)
    helper.enable()
    try:
        images = pipe(PROMPT, height=64, width=64, num_inference_steps=steps, guidance_scale=5.0,
                      generator=torch.Generator().manual_seed(seed), output_type="np").images
    finally:
        helper.disable()
    return (images * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def sd15_folder(tiny_model_factory):
    return tiny_model_factory("sd15")


@pytest.fixture(scope="module")
def reference_pipeline(sd15_folder):
    return EnginePipeline(sd15_folder, "sd15", reference_runners(sd15_folder, "sd15", step_cache=CACHE),
                          step_cache=CACHE)


def test_reference_schedule_equals_the_deepcache_package_on_diffusers(reference_pipeline, sd15_folder):
    """Bit for bit: the package hooks diffusers' own pipeline; ours calls unet_deep / unet_shallow."""
    generation = reference_pipeline.generate(GenerationRequest(**ARGS))
    assert generation.timings.step_schedule == "FccFccF"
    expected = diffusers_deepcache(sd15_folder, interval=3, branch=0, steps=7, seed=3)
    np.testing.assert_array_equal(generation.images, expected)
    uncached = reference_pipeline.generate(GenerationRequest(**ARGS, step_cache="off"))
    assert uncached.timings.step_schedule == ""
    assert not np.array_equal(uncached.images, generation.images)  # the cache changed the computation


def test_sdxl_reference_schedule_equals_the_deepcache_package(tiny_model_factory):
    """SDXL's added conditioning (pooled text embeddings, time ids) reaches both pieces."""
    folder = tiny_model_factory("sdxl")
    cache = StepCache(StepCacheMethod.deepcache, interval=2, branch=0)
    pipeline = EnginePipeline(folder, "sdxl", reference_runners(folder, "sdxl", step_cache=cache), step_cache=cache)
    generation = pipeline.generate(GenerationRequest(**{**ARGS, "steps": 4}))
    assert generation.timings.step_schedule == "FcFc"
    np.testing.assert_array_equal(generation.images, diffusers_deepcache(folder, 2, 0, 4, 3, family="sdxl"))


def test_a_bad_step_cache_value_is_one_clear_error(reference_pipeline):
    with pytest.raises(RuntimeInputError, match="STEP_CACHE must be 'on' or 'off', got 'maybe'"):
        reference_pipeline.generate(GenerationRequest(**ARGS, step_cache="maybe"))


@pytest.fixture(scope="module")
def built(built_sd15_step_cache):
    return built_sd15_step_cache


@pytest.fixture(scope="module")
def engine_pipeline(built):
    from trt_diffusion.engines_file import load_engines_file

    config = load_engines_file(built)
    model_dir, family, table = engine_runners(config, "sd15-tiny", "onnxruntime")
    return EnginePipeline(model_dir, family, table, step_cache=config.models["sd15-tiny"].step_cache)


def test_engines_reproduce_the_cached_reference(engine_pipeline, reference_pipeline):
    """ONNX Runtime against torch: within the parity of the engines themselves (the uncached pair's figure)."""
    cached = engine_pipeline.generate(GenerationRequest(**ARGS))
    assert cached.timings.step_schedule == "FccFccF"
    reference = reference_pipeline.generate(GenerationRequest(**ARGS))
    uncached_engine = engine_pipeline.generate(GenerationRequest(**ARGS, step_cache="off"))
    uncached_reference = reference_pipeline.generate(GenerationRequest(**ARGS, step_cache="off"))
    assert np.abs(cached.images.astype(int) - reference.images.astype(int)).max() <= 1
    assert psnr(cached.images, reference.images) >= 50.0
    assert np.abs(uncached_engine.images.astype(int) - uncached_reference.images.astype(int)).max() <= 1
    assert not np.array_equal(cached.images, uncached_engine.images)


def test_step_cache_off_is_the_uncached_engine(built, engine_pipeline):
    """STEP_CACHE=off runs the uncached UNet engine: the image of a pipeline built without any step cache."""
    from trt_diffusion.engines_file import load_engines_file

    config = load_engines_file(built)
    model_dir, family, table = engine_runners(config, "sd15-tiny", "onnxruntime")
    plain = EnginePipeline(model_dir, family, table)  # no step cache: every step on the uncached engine
    np.testing.assert_array_equal(engine_pipeline.generate(GenerationRequest(**ARGS, step_cache="off")).images,
                                  plain.generate(GenerationRequest(**ARGS)).images)


def test_requests_with_different_schedules_batch_apart_and_equal_their_single_images(engine_pipeline):
    requests = [GenerationRequest(**{**ARGS, "seed": 1}), GenerationRequest(**{**ARGS, "seed": 2}, step_cache="off"),
                GenerationRequest(**{**ARGS, "seed": 3}), GenerationRequest(**{**ARGS, "seed": 4}, step_cache="on")]
    _, batches = engine_pipeline.plan_batches(requests)
    together = {frozenset(b) for b in batches}
    assert frozenset({1}) in together, batches  # off never shares a call with on
    assert any(len(b) == 2 for b in together), batches  # cached requests of one schedule do share calls
    results = engine_pipeline.generate_batch(requests)
    for request, result in zip(requests, results):
        np.testing.assert_array_equal(result.images, engine_pipeline.generate(request).images)
