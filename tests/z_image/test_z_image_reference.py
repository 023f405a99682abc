"""Z-Image's loop over the torch-reference runners equals diffusers' ZImagePipeline of the same tiny folder, bit for
bit (issue #42, acceptance 4): Z-Image with CFG (the prompt's and the negative prompt's rows in one call, their
states of different lengths padded with a mask), Z-Image-Turbo's request (8 steps, guidance 0: no CFG, one call),
a negative prompt, non-square with two images per prompt; and the family's request inputs cfg_normalization and
cfg_truncation at values other than diffusers' defaults."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def pair(tiny_model_factory):
    from diffusers import ZImagePipeline

    folder = tiny_model_factory("z_image")
    theirs = ZImagePipeline.from_pretrained(folder)
    theirs.set_progress_bar_config(disable=True)
    return EnginePipeline(folder, "z_image", reference_runners(folder, "z_image")), theirs


def diffusers_images(pipe, *, prompt=PROMPT, negative_prompt=None, guidance=5.0, height=64, width=64, steps=2,
                     seed=0, batch=1, **inputs):
    images = pipe(prompt=prompt, negative_prompt=negative_prompt, guidance_scale=guidance, height=height, width=width,
                  num_inference_steps=steps, num_images_per_prompt=batch, generator=torch.Generator().manual_seed(seed),
                  output_type="np", **inputs).images
    return (images * 255).round().astype(np.uint8)


@pytest.mark.parametrize("case", [
    dict(),  # Z-Image: CFG with diffusers' empty negative prompt (a shorter prompt: a masked row)
    dict(guidance=0.0, steps=8, seed=3),  # Z-Image-Turbo's request: no CFG
    dict(negative_prompt="blurry, low quality, a drawing of a square", guidance=3.5, seed=7),
    dict(height=64, width=96, batch=2, seed=11),  # non-square, two images per prompt
], ids=["z-image-cfg", "turbo", "negative-prompt", "nonsquare-2-images"])
def test_equals_diffusers(pair, case):
    ours, theirs = pair
    request = GenerationRequest(prompt=case.get("prompt", PROMPT), negative_prompt=case.get("negative_prompt"),
                                guidance_scale=case.get("guidance", 5.0), height=case.get("height", 64),
                                width=case.get("width", 64), steps=case.get("steps", 2), seed=case.get("seed", 0),
                                batch=case.get("batch", 1))
    generation = ours.generate(request)
    assert generation.cfg_mode == ("batched" if request.guidance_scale > 0 else "none")
    expected = diffusers_images(theirs, **case)
    assert generation.images.shape == expected.shape
    np.testing.assert_array_equal(generation.images, expected)


@pytest.mark.parametrize("inputs", [
    {"cfg_normalization": 1.0},  # diffusers' True: the guided prediction's norm capped at the prompt's
    {"cfg_truncation": 0.3},  # guidance 0 at the later steps (normalized time above 0.3)
    {"cfg_normalization": 0.9, "cfg_truncation": 0.5},
], ids=["normalization", "truncation", "both"])
def test_cfg_inputs_equal_diffusers(pair, inputs):
    """The family's declared request inputs (families/z_image.py) run as ZImagePipeline runs its arguments."""
    ours, theirs = pair
    request = GenerationRequest(prompt=PROMPT, guidance_scale=5.0, height=64, width=64, steps=3, seed=5,
                                inputs=dict(inputs))
    generation = ours.generate(request)
    assert generation.cfg_mode == "batched"
    expected = diffusers_images(theirs, steps=3, seed=5, **inputs)
    np.testing.assert_array_equal(generation.images, expected)
    assert not np.array_equal(expected, diffusers_images(theirs, steps=3, seed=5)), "the value changes nothing"
