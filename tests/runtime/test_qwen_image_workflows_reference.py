"""Qwen-Image's img2img and inpaint over the torch-reference runners equal diffusers' QwenImageImg2ImgPipeline and
QwenImageInpaintPipeline of the same tiny folder, bit for bit (issue #26): strengths below and at 1, true CFG on and
off, a non-square size, two images per prompt; and the workflows' refusals in the runtime's words."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline
from PIL import Image

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.sample_inputs import init_image, inpaint_mask

PROMPT = "a lighthouse on a cliff at dusk"
NEGATIVE = "blurry, low quality"
COMPONENTS = ["text_encoder", "transformer", "vae_encoder", "vae_decoder"]
DIFFUSERS = {"img2img": QwenImageImg2ImgPipeline, "inpaint": QwenImageInpaintPipeline}


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("qwen_image")


@pytest.fixture(scope="module")
def ours(folder):
    return EnginePipeline(folder, "qwen_image", reference_runners(folder, "qwen_image", components=COMPONENTS))


@pytest.fixture(scope="module")
def theirs(folder):
    cache = {}

    def get(workflow: str):
        if workflow not in cache:
            cache[workflow] = DIFFUSERS[workflow].from_pretrained(folder)
            cache[workflow].set_progress_bar_config(disable=True)
        return cache[workflow]

    return get


def case_inputs(workflow: str, height: int, width: int, seed: int) -> dict:
    inputs = {"init_image": init_image(height, width, seed)}
    if workflow == "inpaint":
        inputs["mask"] = inpaint_mask(height, width, seed)
    return inputs


def run_theirs(pipe, workflow, *, strength, negative_prompt=None, guidance=4.0, height=64, width=64, steps=4,
               seed=0, batch=1):
    inputs = case_inputs(workflow, height, width, seed)
    extra = dict(image=Image.fromarray(inputs["init_image"]))
    if workflow == "inpaint":
        extra["mask_image"] = Image.fromarray(inputs["mask"])
    images = pipe(PROMPT, negative_prompt=negative_prompt, true_cfg_scale=guidance, height=height, width=width,
                  strength=strength, num_inference_steps=steps, num_images_per_prompt=batch,
                  generator=torch.Generator().manual_seed(seed), output_type="np", **extra).images
    return (images * 255).round().astype(np.uint8)


def request(workflow, *, strength, negative_prompt=None, guidance=4.0, height=64, width=64, steps=4, seed=0,
            batch=1) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, negative_prompt=negative_prompt, guidance_scale=guidance, height=height,
                             width=width, steps=steps, seed=seed, batch=batch, workflow=workflow, strength=strength,
                             **case_inputs(workflow, height, width, seed))


SLOW = pytest.mark.slow  # the default run keeps one case of each start (the slow ones add sizes and rows)


@pytest.mark.parametrize("workflow,case", [
    pytest.param("img2img", dict(strength=0.6), id="img2img", marks=SLOW),
    pytest.param("img2img", dict(strength=0.75, negative_prompt=NEGATIVE, seed=3), id="img2img-cfg"),  # 2 calls a step
    pytest.param("img2img", dict(strength=1.0, negative_prompt="", guidance=2.5, height=64, width=96, batch=2, seed=11),
                 id="img2img-full-wide-2-images", marks=SLOW),
    pytest.param("inpaint", dict(strength=0.6, seed=5), id="inpaint"),  # the known region blended back each step
    # from the noise (the first sigma is 1); the init image still encoded, its draw first
    pytest.param("inpaint", dict(strength=1.0, negative_prompt=NEGATIVE, seed=2), id="inpaint-full-cfg"),
    # one latent sample for both rows; the mask packed on a non-square grid
    pytest.param("inpaint", dict(strength=0.8, height=96, width=64, batch=2, seed=7), id="inpaint-tall-2-images"),
])
def test_equals_diffusers(ours, theirs, workflow, case):
    generation = ours.generate(request(workflow, **case))
    expected = run_theirs(theirs(workflow), workflow, **case)
    assert generation.images.shape == expected.shape
    np.testing.assert_array_equal(generation.images, expected)


def test_the_workflows_are_served_and_refused_by_name(folder, ours):
    assert [w.value for w in ours.workflows] == ["txt2img", "img2img", "inpaint"]
    without_encoder = EnginePipeline(folder, "qwen_image", reference_runners(folder, "qwen_image"))
    assert [w.value for w in without_encoder.workflows] == ["txt2img"]  # no vae_encoder runner: text-to-image only
    for pipeline, change, message in (
            (ours, dict(workflow="edit"), r"WORKFLOW edit is not served: edit needs an edit checkpoint "
                                          r"\(QwenImageEditPipeline\), this one is QwenImagePipeline"),
            (ours, dict(strength=1.5), r"STRENGTH must be in \(0, 1\], got 1.5"),
            (ours, dict(mask=None, workflow="inpaint"), "WORKFLOW inpaint needs MASK"),
            (without_encoder, {}, "WORKFLOW img2img is not served")):
        fields = dict(prompt=PROMPT, height=64, width=64, steps=4, init_image=init_image(64, 64),
                      mask=None, workflow="img2img")
        fields.update(change)
        with pytest.raises(RuntimeInputError, match=message):
            pipeline.validate(GenerationRequest(**fields))
