"""FLUX.1 without a guidance embedding (schnell's layout, the DiT micro-model) runs diffusers' true CFG: with a
NEGATIVE_PROMPT ("" counts) and GUIDANCE_SCALE > 1, each step calls the transformer for the prompt and for the
negative prompt and takes negative + scale * (positive - negative), as FluxPipeline does with `true_cfg_scale`. Over
the torch-reference runners the images equal FluxPipeline's bit for bit; without a negative prompt nothing changes
(one call per step, as before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from trt_diffusion.families import Component
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.schedulers import make_scheduler

PROMPT = "a red circle on a blue background"
SIZE = 64
MAX_SEQUENCE = 32  # the tiny T5's length (models/tiny.py)
COMPONENTS = [Component.text_encoder, Component.text_encoder_2, Component.transformer, Component.vae_decoder]


@pytest.fixture(scope="module")
def guidance_free_flux(tiny_model_factory, tmp_path_factory):
    """The tiny FLUX folder with its transformer rebuilt (seeded) without the guidance embedding."""
    pipe = FluxPipeline.from_pretrained(tiny_model_factory("flux"))
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    torch.manual_seed(3)
    pipe.transformer = FluxTransformer2DModel(**{**config, "guidance_embeds": False})
    folder = tmp_path_factory.mktemp("flux-no-guidance")
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ours(guidance_free_flux):
    return EnginePipeline(guidance_free_flux, "flux", reference_runners(guidance_free_flux, "flux",
                                                                          components=COMPONENTS))


def diffusers_images(folder, *, seed, steps, batch=1, **guidance) -> np.ndarray:
    pipe = FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler("default", dict(pipe.scheduler.config), "flux")
    out = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=steps, num_images_per_prompt=batch,
               generator=torch.Generator().manual_seed(seed), output_type="np", max_sequence_length=MAX_SEQUENCE,
               **guidance).images
    return (out * 255).round().astype(np.uint8)


@pytest.mark.parametrize("batch", [1, 2])
def test_true_cfg_equals_flux_pipelines_true_cfg_scale(ours, guidance_free_flux, batch):
    request = GenerationRequest(prompt=PROMPT, negative_prompt="", guidance_scale=4.0, height=SIZE, width=SIZE,
                                steps=4, seed=7, batch=batch)
    mine = ours.generate(request).images
    theirs = diffusers_images(guidance_free_flux, seed=7, steps=4, batch=batch, true_cfg_scale=4.0,
                              negative_prompt="")
    np.testing.assert_array_equal(mine, theirs)
    plain = diffusers_images(guidance_free_flux, seed=7, steps=4, batch=batch)
    assert not np.array_equal(theirs, plain)  # the negative call changed the picture: the case tests something


def test_without_a_negative_prompt_one_call_per_step(ours, guidance_free_flux):
    request = GenerationRequest(prompt=PROMPT, guidance_scale=4.0, height=SIZE, width=SIZE, steps=3, seed=2)
    np.testing.assert_array_equal(ours.generate(request).images,
                                  diffusers_images(guidance_free_flux, seed=2, steps=3, true_cfg_scale=4.0))


def test_parity_guides_a_guidance_free_flux_with_an_empty_negative_prompt(ours, tiny_model_factory):
    """Parity's requests run the model's guided path: true CFG for a transformer without a guidance embedding (it
    ran unguided before), the embedded guidance (no negative prompt) for one with it."""
    from trt_diffusion.parity.stage import parity_negative_prompt

    request = GenerationRequest(prompt=PROMPT, height=SIZE, width=SIZE, steps=2, guidance_scale=3.5, seed=0)
    assert parity_negative_prompt("flux", request, ours.loop) == ""
    embedded = EnginePipeline(tiny_model_factory("flux"), "flux",
                              reference_runners(tiny_model_factory("flux"), "flux", components=COMPONENTS))
    assert parity_negative_prompt("flux", request, embedded.loop) is None
