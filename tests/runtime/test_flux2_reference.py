"""FLUX.2's loop over the torch-reference runners equals diffusers' Flux2Pipeline (dev: embedded guidance, one call
per step) and Flux2KleinPipeline (true CFG, two calls) of the same tiny folders, bit for bit (issue #26): square
and non-square, several images per prompt, a prompt past the 512-token padding, Klein with CFG off and with a
negative prompt (which diffusers takes as negative_prompt_embeds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners

PROMPT = "a lighthouse on a cliff at dusk"
PAST_LIMIT = "fox " * 200  # 800 byte-level tokens after the template: truncated at 512 by both


@pytest.fixture(scope="module", params=["flux2", "flux2_klein"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def pair(tiny_model_factory, family):
    folder = tiny_model_factory(family)
    ours = EnginePipeline(folder, family, reference_runners(folder, family))
    theirs = (Flux2Pipeline if family == "flux2" else Flux2KleinPipeline).from_pretrained(folder)
    theirs.set_progress_bar_config(disable=True)
    return ours, theirs


def diffusers_images(pipe, *, prompt=PROMPT, negative_prompt=None, guidance=4.0, height=64, width=64, steps=3,
                     seed=0, batch=1):
    extra = {}
    if negative_prompt:  # Flux2KleinPipeline's own negative is ""; another one arrives as embeddings
        extra["negative_prompt_embeds"] = pipe.encode_prompt(negative_prompt, num_images_per_prompt=batch)[0]
    images = pipe(prompt=prompt, guidance_scale=guidance, height=height, width=width, num_inference_steps=steps,
                  num_images_per_prompt=batch, generator=torch.Generator().manual_seed(seed), output_type="np",
                  **extra).images
    return (images * 255).round().astype(np.uint8)


def request(*, prompt=PROMPT, negative_prompt=None, guidance=4.0, height=64, width=64, steps=3, seed=0, batch=1):
    return GenerationRequest(prompt=prompt, negative_prompt=negative_prompt, guidance_scale=guidance, height=height,
                             width=width, steps=steps, seed=seed, batch=batch)


@pytest.mark.parametrize("case", [
    dict(),
    dict(guidance=1.0, seed=5),  # Klein: CFG off at scale 1; dev: guidance 1 embedded
    dict(height=64, width=96, batch=2, seed=11, guidance=2.5),  # non-square, 2 per prompt
    dict(height=96, width=64, steps=4, seed=2),
    dict(prompt=PAST_LIMIT, seed=4),
], ids=["default", "scale-1", "nonsquare-wide-2-images", "nonsquare-tall", "past-limit"])
def test_equals_diffusers(pair, family, case):
    ours, theirs = pair
    generation = ours.generate(request(**case))
    cfg = family == "flux2_klein" and case.get("guidance", 4.0) > 1
    assert generation.cfg_mode == ("split" if cfg else "none")
    expected = diffusers_images(theirs, **case)
    assert generation.images.shape == expected.shape
    np.testing.assert_array_equal(generation.images, expected)


def test_klein_negative_prompt_equals_diffusers_embeddings(pair, family):
    if family != "flux2_klein":
        pytest.skip("FLUX.2 dev has no negative prompt (embedded guidance)")
    ours, theirs = pair
    case = dict(negative_prompt="blurry, low quality", guidance=5.0, seed=7)
    np.testing.assert_array_equal(ours.generate(request(**case)).images, diffusers_images(theirs, **case))


def test_max_sequence_length_is_refused(pair):
    ours, _ = pair
    with pytest.raises(RuntimeInputError, match="MAX_SEQUENCE_LENGTH is the qwen_image family's"):
        ours.generate(GenerationRequest(prompt=PROMPT, height=64, width=64, steps=2, max_sequence_length=64))
