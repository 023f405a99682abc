"""The pipeline over torch-reference runners reproduces diffusers' own pipelines, image for image."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline as DiffusersPipeline

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.pipeline import DiffusionPipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.schedulers import make_scheduler

PROMPT = "a lighthouse on a cliff at dusk"


def ours(folder, family, **request):
    pipe = DiffusionPipeline(folder, family, reference_runners(folder, family))
    return pipe.generate(GenerationRequest(prompt=PROMPT, **request))


def theirs(folder, family, *, height, width, steps, guidance_scale, seed, scheduler="default", batch=1, **extra):
    pipe = DiffusersPipeline.from_pretrained(folder)
    if scheduler != "default":
        pipe.scheduler = make_scheduler(scheduler, dict(pipe.scheduler.config), family)
    images = pipe(PROMPT, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance_scale,
                  generator=torch.Generator().manual_seed(seed), output_type="np", num_images_per_prompt=batch,
                  **extra).images
    return (images * 255).round().astype(np.uint8)


@pytest.mark.parametrize("family,extra", [
    ("sd15", {}), ("sdxl", {}), ("sd3", {"max_sequence_length": 32}), ("flux", {"max_sequence_length": 32}),
])
def test_reference_pipeline_equals_diffusers(tiny_model_factory, family, extra):
    folder = tiny_model_factory(family)
    args = dict(height=64, width=64, steps=4, guidance_scale=5.0, seed=7)
    mine = ours(folder, family, **args).images
    reference = theirs(folder, family, **args, **extra)
    assert mine.shape == reference.shape == (1, 64, 64, 3)
    np.testing.assert_array_equal(mine, reference)


@pytest.mark.parametrize("scheduler", ["euler", "euler_a", "dpmpp_2m_karras", "ddim", "unipc"])
def test_every_unet_scheduler_matches_diffusers(tiny_model_factory, scheduler):
    folder = tiny_model_factory("sd15")
    args = dict(height=64, width=64, steps=5, guidance_scale=6.0, seed=3, scheduler=scheduler)
    mine, reference = ours(folder, "sd15", **args).images[0].astype(int), theirs(folder, "sd15", **args)[0]
    # Bit-exact in most runs; the UNet gets its timestep as a [B] tensor where diffusers expands a
    # scalar, which can move one float rounding in the UNet and so one pixel by one level.
    difference = np.abs(mine - reference)
    assert difference.max() <= 1 and (difference > 0).mean() < 1e-3


def test_same_request_twice_is_identical(tiny_model_factory):
    folder = tiny_model_factory("sd15")
    pipe = DiffusionPipeline(folder, "sd15", reference_runners(folder, "sd15"))
    request = GenerationRequest(prompt=PROMPT, height=64, width=64, steps=3, seed=11, scheduler="euler_a")
    np.testing.assert_array_equal(pipe.generate(request).images, pipe.generate(request).images)


def test_image_does_not_depend_on_its_batch(tiny_model_factory):
    """The first image of a batch of 2 is the batch-1 image: the other image does not leak into it."""
    folder = tiny_model_factory("sd15")
    pipe = DiffusionPipeline(folder, "sd15", reference_runners(folder, "sd15"))
    one = pipe.generate(GenerationRequest(prompt=PROMPT, height=64, width=64, steps=3, seed=5)).images
    two = pipe.generate(GenerationRequest(prompt=PROMPT, height=64, width=64, steps=3, seed=5, batch=2)).images
    assert two.shape[0] == 2
    assert np.abs(one[0].astype(int) - two[0].astype(int)).max() <= 1
    assert np.abs(two[0].astype(int) - two[1].astype(int)).max() > 10  # different noise, different image


def test_concurrent_requests_do_not_share_scheduler_state(tiny_model_factory):
    folder = tiny_model_factory("sd15")
    pipe = DiffusionPipeline(folder, "sd15", reference_runners(folder, "sd15"))
    requests = [GenerationRequest(prompt=PROMPT, height=64, width=64, steps=4, seed=s, scheduler="dpmpp_2m_karras")
                for s in range(4)]
    alone = [pipe.generate(r).images for r in requests]
    together = [None] * len(requests)

    def work(i):
        together[i] = pipe.generate(requests[i]).images

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("change,fragment", [
    ({"prompt": ""}, "PROMPT is empty"),
    ({"prompt": "x" * 10_000}, "10000 characters"),
    ({"steps": 0}, "STEPS must be between 1 and 1000"),
    ({"steps": 10_000}, "STEPS must be between 1 and 1000"),
    ({"width": 60}, "not a positive multiple of 8"),
    ({"scheduler": "magic"}, "unknown scheduler 'magic'"),
    ({"controlnet": "canny"}, "no ControlNet named 'canny'"),
])
def test_bad_requests_are_clear_errors(tiny_model_factory, change, fragment):
    folder = tiny_model_factory("sd15")
    pipe = DiffusionPipeline(folder, "sd15", reference_runners(folder, "sd15"))
    request = GenerationRequest(**{**dict(prompt=PROMPT, height=64, width=64, steps=2), **change})
    with pytest.raises(RuntimeInputError, match=fragment):
        pipe.generate(request)
