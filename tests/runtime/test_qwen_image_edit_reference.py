"""Qwen-Image-Edit over the torch-reference runners equals diffusers' QwenImageEditPipeline of the same tiny folder,
bit for bit (issue #26), with one thing changed on diffusers' side: its text encoder gets the processor's
`mm_token_type_ids`.

Why that change: with transformers 5, Qwen2.5-VL computes its 3D (mRoPE) position ids only from the processor's
`mm_token_type_ids`, which QwenImageEditPipeline does not pass on, so the pinned pipeline silently runs the image
tokens at plain sequential positions — not what the model was trained with (diffusers issue #14194, fix open as
#14189). The runtime computes the 3D ids (`rope_positions`), so the reference is diffusers with that fix; a test
below shows the unfixed pipeline is the one that differs, and why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline
from PIL import Image
from transformers import AutoTokenizer

from trt_diffusion.components.qwen_image_edit import rope_positions
from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.families import QWEN_EDIT_TEMPLATE
from trt_diffusion.models.edit_reference import image_processor
from trt_diffusion.models.tiny_qwen import edit_processor
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.sample_inputs import init_image

PROMPT = "make it a night scene"
COMPONENTS = ["text_encoder", "image_encoder", "transformer", "vae_encoder", "vae_decoder"]


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("qwen_image", variant="edit")


@pytest.fixture(scope="module")
def ours(folder):
    return EnginePipeline(folder, "qwen_image", reference_runners(folder, "qwen_image", components=COMPONENTS))


def diffusers_pipeline(folder, forward_token_types: bool) -> QwenImageEditPipeline:
    """The folder's QwenImageEditPipeline; its processor built without the video part (transformers' own needs
    torchvision); `forward_token_types`: the text encoder gets `mm_token_type_ids` (diffusers #14189's fix)."""
    tokenizer = AutoTokenizer.from_pretrained(folder / "processor")
    pipe = QwenImageEditPipeline.from_pretrained(folder, processor=edit_processor(tokenizer, image_processor(folder)))
    pipe.set_progress_bar_config(disable=True)
    if forward_token_types:
        encoder, image_id = pipe.text_encoder, pipe.text_encoder.config.image_token_id
        forward = encoder.forward

        def with_token_types(*args, input_ids=None, **kwargs):
            kwargs.setdefault("mm_token_type_ids", (input_ids == image_id).int())  # the processor's (tested below)
            return forward(*args, input_ids=input_ids, **kwargs)

        encoder.forward = with_token_types
    return pipe


@pytest.fixture(scope="module")
def theirs(folder):
    return diffusers_pipeline(folder, forward_token_types=True)


def run_theirs(pipe, image, *, negative_prompt=None, guidance=4.0, height=64, width=64, steps=2, seed=0, batch=1):
    images = pipe(image=Image.fromarray(image), prompt=PROMPT, negative_prompt=negative_prompt,
                  true_cfg_scale=guidance, height=height, width=width, num_inference_steps=steps,
                  num_images_per_prompt=batch, generator=torch.Generator().manual_seed(seed), output_type="np").images
    return (images * 255).round().astype(np.uint8)


def request(image, *, negative_prompt=None, guidance=4.0, height=64, width=64, steps=2, seed=0, batch=1):
    return GenerationRequest(prompt=PROMPT, negative_prompt=negative_prompt, guidance_scale=guidance, height=height,
                             width=width, steps=steps, seed=seed, batch=batch, workflow="edit", init_image=image)


@pytest.mark.parametrize("case", [
    pytest.param(dict(size=(64, 64), image=(64, 64)), id="square"),
    # true CFG (two calls a step, the image's embeddings in both prompts), a wide size, two images, and a reference
    # image of another size at the same aspect (resized to the same 1248x832)
    pytest.param(dict(size=(64, 96), image=(96, 144), negative_prompt="blurry", batch=2, seed=3),
                 id="wide-cfg-2-images", marks=pytest.mark.slow),
])
def test_equals_diffusers(ours, theirs, case):
    (height, width), (image_h, image_w) = case.pop("size"), case.pop("image")
    image = init_image(image_h, image_w, case.get("seed", 0))
    generation = ours.generate(request(image, height=height, width=width, **case))
    expected = run_theirs(theirs, image, height=height, width=width, **case)
    assert generation.images.shape == expected.shape
    np.testing.assert_array_equal(generation.images, expected)


def test_position_ids_are_qwen2_5_vls_and_the_pinned_pipeline_drops_them(folder, ours, theirs):
    """`rope_positions` equals transformers' get_rope_index on the processor's own output (its token types
    included), and the pinned pipeline without them encodes the prompt differently: what the fix is for."""
    image = ours.qwen._reference(request(init_image(64, 64)))
    inputs = theirs.processor(text=[QWEN_EDIT_TEMPLATE.format(PROMPT)], images=image, padding=True,
                              return_tensors="pt")
    model = theirs.text_encoder.model
    image_id = model.config.image_token_id
    assert torch.equal(inputs["mm_token_type_ids"], (inputs["input_ids"] == image_id).int())
    expected, _ = model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                       attention_mask=inputs["attention_mask"])
    grid = tuple(inputs["image_grid_thw"][0, 1:].tolist())
    mine = rope_positions(inputs["input_ids"].numpy(), image_id, grid, 2)
    np.testing.assert_array_equal(mine, expected.numpy())
    assert not np.array_equal(mine[1], np.arange(mine.shape[-1])[None])  # the image's rows and columns differ

    pinned = diffusers_pipeline(folder, forward_token_types=False)
    fixed_embeds, _ = theirs.encode_prompt(image=image, prompt=PROMPT)
    pinned_embeds, _ = pinned.encode_prompt(image=image, prompt=PROMPT)
    assert not torch.equal(fixed_embeds, pinned_embeds)


def test_edit_is_served_and_refused_by_name(folder, ours):
    assert [w.value for w in ours.workflows] == ["edit"]
    for change, message in (
            (dict(init_image=init_image(80, 112)), "INIT_IMAGE is 112x80: Qwen-Image-Edit resizes it to 1216x864, "
                                                   "but a 64x64 request's reference is resized to 1024x1024"),
            (dict(workflow="img2img"), "WORKFLOW img2img is not served"),
            (dict(init_image=None), "WORKFLOW edit needs INIT_IMAGE")):
        fields = dict(prompt=PROMPT, height=64, width=64, steps=2, init_image=init_image(64, 64), workflow="edit")
        fields.update(change)
        with pytest.raises(RuntimeInputError, match=message):
            ours.validate(GenerationRequest(**fields))
