"""FLUX's image-conditioned workflows over the torch-reference runners equal diffusers' own FLUX pipelines of the
same tiny folder, bit for bit (acceptance 1 of the image-conditioned issue): img2img (FluxImg2ImgPipeline), inpaint
with the plain transformer (FluxInpaintPipeline: the known region blended back on packed latents), FLUX.1 Fill
(FluxFillPipeline: masked-image latents and the mask as extra channels) and FLUX.1 Kontext edit
(FluxKontextPipeline: the init image's tokens beside the noise's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxFillPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline
from PIL import Image

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.families import Component, family_info
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.runners import CallableRunner
from trt_diffusion.runtime.schedulers import make_scheduler
from trt_diffusion.sample_inputs import init_image, inpaint_mask
from trt_diffusion.targets.runner_base import TensorSpec

PROMPT = "a lighthouse on a cliff at dusk"
SIZE = 64
MAX_SEQUENCE = 32  # the tiny T5's length (models/tiny.py)
DIFFUSERS = {("img2img", None): FluxImg2ImgPipeline, ("inpaint", None): FluxInpaintPipeline,
             ("inpaint", "fill"): FluxFillPipeline, ("edit", "kontext"): FluxKontextPipeline}


def _components(folder):
    from trt_diffusion.models.loading import SUBFOLDER, read_model_index

    index = read_model_index(folder)
    return [c for c in family_info("flux").components
            if c is not Component.controlnet and index.get(SUBFOLDER[c], [None])[0]]


@pytest.fixture(scope="module")
def ours(tiny_model_factory):
    cache = {}

    def get(variant: str | None = None) -> EnginePipeline:
        if variant not in cache:
            folder = tiny_model_factory("flux", variant=variant)
            cache[variant] = EnginePipeline(folder, "flux", reference_runners(folder, "flux",
                                                                              components=_components(folder)))
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def theirs(tiny_model_factory):
    cache = {}

    def get(workflow: str, variant: str | None = None):
        if (workflow, variant) not in cache:
            pipe = DIFFUSERS[workflow, variant].from_pretrained(tiny_model_factory("flux", variant=variant))
            pipe.set_progress_bar_config(disable=True)
            cache[workflow, variant] = (pipe, dict(pipe.scheduler.config))
        return cache[workflow, variant]

    return get


def run_theirs(loaded, *, workflow, steps, guidance_scale, seed, strength=None, batch=1, output_type="np"):
    pipe, scheduler_config = loaded
    pipe.scheduler = make_scheduler("default", scheduler_config, "flux")
    extra = dict(image=Image.fromarray(init_image(SIZE, SIZE, seed)))
    if workflow == "inpaint":
        extra["mask_image"] = Image.fromarray(inpaint_mask(SIZE, SIZE, seed))
    if strength is not None:
        extra["strength"] = strength
    if workflow == "edit":
        # we never resize: an INIT_IMAGE is the request's size, and the output is the request's size (Kontext
        # would scale it to max_area, 1024^2 by default)
        extra.update(_auto_resize=False, max_area=SIZE * SIZE)
    out = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=steps, guidance_scale=guidance_scale,
               generator=torch.Generator().manual_seed(seed), output_type=output_type, num_images_per_prompt=batch,
               max_sequence_length=MAX_SEQUENCE, **extra).images
    return out if output_type == "latent" else (out * 255).round().astype(np.uint8)


def request(workflow, seed, **values):
    fields = dict(prompt=PROMPT, height=SIZE, width=SIZE, seed=seed, workflow=workflow, steps=4,
                  guidance_scale=3.5)
    if workflow != "txt2img":
        fields["init_image"] = init_image(SIZE, SIZE, seed)
    if workflow == "inpaint":
        fields["mask"] = inpaint_mask(SIZE, SIZE, seed)
    fields.update(values)
    return GenerationRequest(**fields)


@pytest.mark.parametrize("workflow,variant,strength", [
    ("img2img", None, 0.6),
    ("inpaint", None, 0.6),  # the plain transformer: the known region blended back after each step
    ("inpaint", None, 1.0),  # from pure noise; the init image still encoded (its draw comes first)
    ("inpaint", "fill", 1.0),  # FLUX.1 Fill: masked-image latents and the mask as channels
    ("inpaint", "fill", 0.7),
    ("edit", "kontext", None),  # FLUX.1 Kontext: the image's tokens beside the noise's, the full schedule
])
def test_flux_workflow_equals_diffusers(ours, theirs, workflow, variant, strength):
    args = dict(steps=5, guidance_scale=3.5, seed=11)
    mine = ours(variant).generate(request(workflow, strength=strength, **args)).images
    reference = run_theirs(theirs(workflow, variant), workflow=workflow, strength=strength, **args)
    assert mine.shape == reference.shape == (1, SIZE, SIZE, 3)
    np.testing.assert_array_equal(mine, reference)


@pytest.mark.parametrize("workflow,variant,strength", [("inpaint", None, 0.75), ("edit", "kontext", None)])
def test_images_per_prompt_match_diffusers(ours, theirs, workflow, variant, strength):
    """batch 2 of one init image: one latent sample repeated to both rows, then two rows of noise."""
    args = dict(steps=4, guidance_scale=4.0, seed=5, batch=2)
    mine = ours(variant).generate(request(workflow, strength=strength, **args)).images
    reference = run_theirs(theirs(workflow, variant), workflow=workflow, strength=strength, **args)
    assert mine.shape == (2, SIZE, SIZE, 3)
    np.testing.assert_array_equal(mine, reference)


def test_mixed_flux_batch_each_equal_their_own(ours):
    """generate_batch over FLUX requests of every workflow: each image is the one the request gets alone, and a bad
    request is answered alone with its own error. FLUX requests do not share transformer calls (runtime/flux_loop.py:
    a one-row call rounds differently than a batched one), so every batch key is the request's own."""
    pipe = ours()
    requests = [request("img2img", 1, strength=0.5), request("txt2img", 2), request("img2img", 3, strength=0.5),
                request("inpaint", 4, strength=0.5), request("txt2img", 6, batch=2),
                request("img2img", 7, strength=0.5, init_image=np.zeros((32, 64, 3), np.uint8))]
    assert len({pipe.batch_key(r) for r in requests}) == len(requests)
    alone = [pipe.generate(r).images for r in requests[:-1]]
    together = pipe.generate_batch(requests)
    assert isinstance(together[-1], RuntimeInputError) and "INIT_IMAGE is [32, 64, 3]" in str(together[-1])
    for one, batched in zip(alone, together):
        assert batched.timings.batch == 1
        np.testing.assert_array_equal(one, batched.images)


def test_kontext_edits_in_a_batch_each_equal_their_own(ours):
    pipe = ours("kontext")
    requests = [request("edit", 1), request("edit", 2, guidance_scale=2.0)]
    alone = [pipe.generate(r).images for r in requests]
    for one, batched in zip(alone, pipe.generate_batch(requests)):
        np.testing.assert_array_equal(one, batched.images)


def test_checkpoints_serve_their_workflows(ours):
    assert [w.value for w in ours().workflows] == ["txt2img", "img2img", "inpaint"]
    assert [w.value for w in ours("fill").workflows] == ["inpaint"]  # a Fill transformer: inpaint only
    assert [w.value for w in ours("kontext").workflows] == ["edit"]


@pytest.mark.parametrize("variant,workflow,change,message", [
    (None, "edit", {}, "WORKFLOW edit is not served: edit needs an edit checkpoint (FluxKontextPipeline), this one "
                       "is FluxPipeline (served: txt2img, img2img, inpaint)"),
    ("kontext", "edit", {"mask": inpaint_mask(SIZE, SIZE)}, "WORKFLOW edit takes no MASK (inpaint does)"),
    ("kontext", None, {"mask": inpaint_mask(SIZE, SIZE)},
     "WORKFLOW inpaint (a MASK asks for inpaint) is not served: it is not in this model's workflows (served: edit)"),
    ("kontext", "edit", {"strength": 0.5}, "WORKFLOW edit takes no STRENGTH"),
    ("kontext", "edit", {"init_image": None}, "WORKFLOW edit needs INIT_IMAGE"),
    ("kontext", "edit", {"init_image": np.zeros((32, 64, 3), np.uint8)}, "INIT_IMAGE is [32, 64, 3], expected"),
    ("fill", "img2img", {}, "WORKFLOW img2img is not served: it is not in this model's workflows (served: inpaint)"),
    ("fill", "inpaint", {}, "WORKFLOW inpaint needs MASK"),
    (None, "img2img", {"strength": 1.5}, "STRENGTH must be in (0, 1], got 1.5"),
])
def test_bad_flux_requests_are_refused_by_name(ours, variant, workflow, change, message):
    fields = {"init_image": init_image(SIZE, SIZE), "workflow": workflow, **change}
    with pytest.raises(RuntimeInputError) as err:
        ours(variant).validate(GenerationRequest(PROMPT, SIZE, SIZE, steps=4, **fields))
    assert message in str(err.value)


def test_an_edit_transformer_without_the_longer_sequence_is_named(ours):
    """An engine whose image-token dim is fixed at the image's tokens cannot take the edit's noise + context
    tokens: refused before the call, naming what the edit needs."""
    pipe = ours("kontext")
    transformer = next(e.runner for e in pipe.runners.entries if e.component == "transformer")
    tokens = (SIZE // 16) ** 2
    inputs = dict(transformer.inputs, hidden_states=TensorSpec(np.dtype(np.float32), (None, tokens, 16)),
                  img_ids=TensorSpec(np.dtype(np.float32), (tokens, 3)))
    short = CallableRunner(transformer.run, inputs, name="transformer[64x64, 16 tokens]")
    table = RunnerTable([e for e in pipe.runners.entries if e.component != "transformer"])
    table.add("transformer", short)
    with pytest.raises(RuntimeInputError, match=r"the edit workflow at 64x64 feeds the transformer 32 image tokens "
                                                r"\(the noise's tokens and the init image's: .*\); "
                                                r"transformer\[64x64, 16 tokens\] takes 16"):
        EnginePipeline(pipe.model_dir, "flux", table).generate(request("edit", 0))
