"""img2img and inpaint over the torch-reference runners equal diffusers' own img2img/inpaint pipelines of the same
folder, bit for bit (acceptance 1 of the image-conditioned issue: UNet families and SD3; FLUX in its own file)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batch_rounding import assert_same_image
from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting
from PIL import Image

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.families import Component, family_info
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.schedulers import make_scheduler
from trt_diffusion.sample_inputs import init_image, inpaint_mask

PROMPT = "a lighthouse on a cliff at dusk"
SIZE = 64


def _components(folder, family):
    from trt_diffusion.models.loading import SUBFOLDER, read_model_index

    index = read_model_index(folder)
    return [c for c in family_info(family).components
            if c is not Component.controlnet and index.get(SUBFOLDER[c], [None])[0]]


@pytest.fixture(scope="module")
def ours(tiny_model_factory):
    cache = {}

    def get(family: str, variant: str | None = None) -> EnginePipeline:
        if (family, variant) not in cache:
            folder = tiny_model_factory(family, variant=variant)
            cache[family, variant] = EnginePipeline(folder, family, reference_runners(
                folder, family, components=_components(folder, family)))
        return cache[family, variant]

    return get


@pytest.fixture(scope="module")
def theirs(tiny_model_factory):
    cache = {}

    def get(family: str, workflow: str, variant: str | None = None):
        if (family, workflow, variant) not in cache:
            auto = AutoPipelineForImage2Image if workflow == "img2img" else AutoPipelineForInpainting
            pipe = auto.from_pretrained(tiny_model_factory(family, variant=variant))
            pipe.set_progress_bar_config(disable=True)
            cache[family, workflow, variant] = (pipe, dict(pipe.scheduler.config))
        return cache[family, workflow, variant]

    return get


def run_theirs(loaded, family, *, workflow, steps, strength, guidance_scale, seed, scheduler="default",
               batch=1, output_type="np", **extra):
    pipe, scheduler_config = loaded
    pipe.scheduler = make_scheduler(scheduler, scheduler_config, family)
    images = dict(image=Image.fromarray(init_image(SIZE, SIZE, seed)))
    if workflow == "inpaint":
        images["mask_image"] = Image.fromarray(inpaint_mask(SIZE, SIZE, seed))
        extra.update(height=SIZE, width=SIZE)
    out = pipe(PROMPT, **images, num_inference_steps=steps, strength=strength, guidance_scale=guidance_scale,
               generator=torch.Generator().manual_seed(seed), output_type=output_type, num_images_per_prompt=batch,
               **extra).images
    return out if output_type == "latent" else (out * 255).round().astype(np.uint8)


def request(workflow, seed, **values):
    fields = dict(prompt=PROMPT, height=SIZE, width=SIZE, seed=seed, workflow=workflow,
                  init_image=init_image(SIZE, SIZE, seed))
    if workflow == "inpaint":
        fields["mask"] = inpaint_mask(SIZE, SIZE, seed)
    fields.update(values)
    return GenerationRequest(**fields)


SD3 = {"max_sequence_length": 32}


@pytest.mark.parametrize("family,workflow,variant,strength,extra", [
    ("sd15", "img2img", None, 0.6, {}),
    ("sd15", "inpaint", None, 0.75, {}),  # a 4-channel UNet: the known region blended back after each step
    ("sd15", "inpaint", "inpaint", 1.0, {}),  # the 9-channel inpainting UNet, from pure noise
    ("sd15", "inpaint", "inpaint", 0.7, {}),
    ("sdxl", "img2img", None, 0.5, {}),
    ("sdxl", "inpaint", None, 0.8, {}),
    ("sdxl", "inpaint", "inpaint", 0.9, {}),
    ("sd3", "img2img", None, 0.6, SD3),
])
def test_image_workflow_equals_diffusers(ours, theirs, family, workflow, variant, strength, extra):
    args = dict(steps=5, strength=strength, guidance_scale=5.0, seed=11)
    mine = ours(family, variant).generate(request(workflow, **args)).images
    reference = run_theirs(theirs(family, workflow, variant), family, workflow=workflow, **args, **extra)
    assert mine.shape == reference.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_array_equal(mine, reference)


def test_sd3_inpaint_latents_equal_diffusers(ours, theirs):
    """SD3 inpaint: the final latents bit for bit. The images are not compared: diffusers' SD3 inpaint pipeline
    decodes `latents / scaling_factor` without the VAE's shift_factor (its txt2img and img2img pipelines add it),
    and ours decodes every workflow as txt2img does."""
    pipe = ours("sd3")
    args = dict(steps=5, strength=0.8, guidance_scale=5.0, seed=3)
    req = request("inpaint", **args)
    encoding = pipe.encode(req)
    mine, _ = pipe.denoise(req, encoding)
    reference = run_theirs(theirs("sd3", "inpaint"), "sd3", workflow="inpaint", output_type="latent", **args, **SD3)
    assert torch.equal(mine, reference)


@pytest.mark.parametrize("scheduler", ["euler_a", "dpmpp_2m_karras", "ddim"])
def test_img2img_schedulers_match_diffusers(ours, theirs, scheduler):
    """Trimming by strength sets each scheduler's begin index (multistep and ancestral ones read it)."""
    args = dict(steps=6, strength=0.5, guidance_scale=7.5, seed=5, scheduler=scheduler)
    mine = ours("sd15").generate(request("img2img", **args)).images
    np.testing.assert_array_equal(mine, run_theirs(theirs("sd15", "img2img"), "sd15", workflow="img2img", **args))


def test_images_per_prompt_match_diffusers(ours, theirs):
    """batch 2 of one init image: one encoded latent sample, repeated, then two rows of noise (diffusers' order)."""
    args = dict(steps=4, strength=0.7, guidance_scale=5.0, seed=9, batch=2)
    mine = ours("sd15").generate(request("inpaint", **args)).images
    np.testing.assert_array_equal(mine, run_theirs(theirs("sd15", "inpaint"), "sd15", workflow="inpaint", **args))


def test_mixed_workflows_batch_each_equal_their_own(ours):
    pipe = ours("sd15")
    requests = [request("img2img", 1, steps=4, strength=0.5), GenerationRequest(PROMPT, SIZE, SIZE, steps=4, seed=2),
                request("img2img", 3, steps=4, strength=0.5), request("inpaint", 4, steps=4, strength=0.5),
                request("img2img", 5, steps=4, strength=0.75)]
    keys = {pipe.batch_key(r) for r in requests}
    assert len(keys) == 4  # same workflow and strength batch together; nothing else does
    alone = [pipe.generate(r).images for r in requests]
    together = pipe.generate_batch(requests)
    for one, batched in zip(alone, together):
        assert_same_image(batched.images, one)  # batch 4 rows vs 2: the reference rounds by batch


@pytest.mark.parametrize("change,message", [
    ({"strength": 0.0}, "STRENGTH must be in (0, 1], got 0.0"),
    ({"strength": 1.5}, "STRENGTH must be in (0, 1], got 1.5"),
    ({"strength": 0.1, "steps": 4}, "STRENGTH 0.1 keeps no step of 4"),
    ({"init_image": np.zeros((32, 64, 3), np.uint8)}, "INIT_IMAGE is [32, 64, 3], expected [64, 64, 3]"),
    ({"init_image": np.zeros((64, 64, 3), np.float32)}, "INIT_IMAGE must be uint8"),
    ({"mask": np.zeros((64, 32), np.uint8), "workflow": "inpaint"}, "MASK is [64, 32], expected [64, 64]"),
    ({"workflow": "inpaint", "mask": None}, "WORKFLOW inpaint needs MASK"),
    ({"workflow": "txt2img"}, "WORKFLOW txt2img takes no INIT_IMAGE"),
    ({"workflow": "outpaint"}, "unknown WORKFLOW 'outpaint'; choose one of txt2img, img2img, inpaint, edit"),
    ({"workflow": "edit"}, "WORKFLOW edit is not served: the sd15 family has no edit workflow (served: txt2img, "
                           "img2img, inpaint)"),
    ({"init_image": None, "mask": np.zeros((64, 64), np.uint8)}, "a MASK needs the INIT_IMAGE it masks"),
])
def test_bad_image_inputs_are_refused_by_name(ours, change, message):
    pipe = ours("sd15")
    change = dict(change)
    with pytest.raises(RuntimeInputError) as err:
        pipe.validate(request(change.pop("workflow", "img2img"), 0, **{"steps": 5, **change}))
    assert message in str(err.value)


def test_a_workflow_the_model_does_not_declare_is_refused(ours):
    with pytest.raises(RuntimeInputError, match=r"WORKFLOW img2img is not served: it is not in this model's "
                                                r"workflows \(served: txt2img\)"):
        EnginePipeline(ours("sd15").model_dir, "sd15", ours("sd15").runners, workflows=("txt2img",)
                       ).validate(request("img2img", 0))


def test_a_mask_to_a_model_without_inpaint_is_refused(ours):
    pipe = EnginePipeline(ours("sd15").model_dir, "sd15", ours("sd15").runners, workflows=("txt2img", "img2img"))
    with pytest.raises(RuntimeInputError, match=r"WORKFLOW inpaint \(a MASK asks for inpaint\) is not served"):
        pipe.validate(GenerationRequest(PROMPT, SIZE, SIZE, init_image=init_image(SIZE, SIZE),
                                        mask=inpaint_mask(SIZE, SIZE)))


def test_an_inpainting_checkpoint_serves_inpaint_only(ours):
    assert [w.value for w in ours("sd15", "inpaint").workflows] == ["inpaint"]
    assert [w.value for w in ours("sd15").workflows] == ["txt2img", "img2img", "inpaint"]


def test_img2img_with_a_controlnet_equals_diffusers(tiny_model_factory):
    """img2img + ControlNet (sd15) against diffusers' StableDiffusionControlNetImg2ImgPipeline."""
    from diffusers import ControlNetModel, StableDiffusionControlNetImg2ImgPipeline

    from trt_diffusion.sample_inputs import control_image

    folder = tiny_model_factory("sd15", controlnet=True)
    table = reference_runners(folder, "sd15", components=_components(folder, "sd15"),
                              controlnets={"canny": folder / "controlnet"})
    mine_pipe = EnginePipeline(folder, "sd15", table)
    control = control_image(SIZE, SIZE, 4)
    args = dict(steps=5, strength=0.6, guidance_scale=5.0, seed=4)
    mine = mine_pipe.generate(request("img2img", controlnet="canny", control_image=control, controlnet_scale=0.7,
                                      **args)).images
    pipe = StableDiffusionControlNetImg2ImgPipeline.from_pretrained(
        folder, controlnet=ControlNetModel.from_pretrained(folder / "controlnet"), safety_checker=None,
        requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler("default", dict(pipe.scheduler.config), "sd15")
    theirs_images = pipe(PROMPT, image=Image.fromarray(init_image(SIZE, SIZE, 4)), control_image=Image.fromarray(control),
                         num_inference_steps=5, strength=0.6, guidance_scale=5.0, controlnet_conditioning_scale=0.7,
                         generator=torch.Generator().manual_seed(4), output_type="np").images
    np.testing.assert_array_equal(mine, (theirs_images * 255).round().astype(np.uint8))
