"""Wan image-to-video over the torch-reference runners equals diffusers' own WanImageToVideoPipeline of the same
tiny folder, bit for bit (issue #24): Wan 2.1 I2V (CLIP image embeds beside the text) and Wan 2.2 I2V A14B (two
experts switched at boundary_ratio, guidance_scale_2), 5 and 9 frames, non-square sizes, CFG on and off, two videos
per prompt. Requests that do not fit an image-to-video checkpoint (or ask one of a text-to-video checkpoint) are
refused by name."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.families import Component, family_info
from trt_diffusion.models.loading import SUBFOLDER, read_model_index
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.runners import CallableRunner
from trt_diffusion.runtime.schedulers import make_scheduler

PROMPT = "a red fox running through  snow &amp; pines\n"  # html entity and whitespace: prompt_clean's work


def counted(table: RunnerTable, calls: Counter, *, batch: dict[str, int] | None = None) -> RunnerTable:
    """The same runners, each call counted by component; `batch` gives components a fixed engine batch (as
    test_video_reference.py's)."""
    counting = RunnerTable()
    for entry in table.entries:
        def run(feeds, runner=entry.runner, component=entry.component):
            calls[component] += 1
            return runner.run(feeds)

        counting.add(entry.component, CallableRunner(run, entry.runner.inputs, name=entry.runner.name),
                     batch=(batch or {}).get(entry.component))
    return counting


def init_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth picture with some noise: the clip's first frame."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height) + 64], -1)
    noise = np.random.default_rng(seed).integers(-40, 40, (height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def _components(folder):
    """The folder's components, the VAE encoder included (img2vid encodes the conditioning clip)."""
    index = read_model_index(folder)
    return [c for c in family_info("wan").components
            if c is Component.vae_encoder or index.get(SUBFOLDER[c], [None])[0]]


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """`reference(variant) -> (folder, RunnerTable)`: the torch runners, loaded once per module."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            folder = tiny_model_factory("wan", variant=variant)
            cache[variant] = (folder, reference_runners(folder, "wan", components=_components(folder)))
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def ours(reference):
    """`ours(variant) -> (EnginePipeline, Counter of runner calls)`, shared by the tests (each clears the counter)."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            folder, table = reference(variant)
            calls = Counter()
            cache[variant] = (EnginePipeline(folder, "wan", counted(table, calls)), calls)
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def theirs(tiny_model_factory):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            pipe = WanImageToVideoPipeline.from_pretrained(tiny_model_factory("wan", variant=variant))
            pipe.set_progress_bar_config(disable=True)
            cache[variant] = (pipe, dict(pipe.scheduler.config))
        return cache[variant]

    return get


def run_theirs(loaded, image, *, frames, height, width, steps, guidance_scale, seed, batch=1, **extra):
    pipe, scheduler_config = loaded
    pipe.scheduler = make_scheduler("default", scheduler_config, "wan")  # a fresh one: schedulers keep state
    prompt = dict(prompt=PROMPT)
    if batch > 1 and pipe.transformer.config.image_dim is not None:
        # diffusers repeats Wan 2.1 I2V's image embeds by the prompt count only, so num_videos_per_prompt > 1 fails
        # in the transformer's concat (huggingface/diffusers#13578, open). Its own encode_prompt's rows handed in
        # make the prompt count the rows: embeds, noise and conditioning clip all `batch` rows, as the fix gives.
        # Under no_grad as __call__ runs it: with grad enabled the text encoder's SDPA rounds otherwise (~1e-6).
        with torch.no_grad():
            positive, negative = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=guidance_scale > 1,
                                                    num_videos_per_prompt=batch, max_sequence_length=512)
        prompt = dict(prompt_embeds=positive, negative_prompt_embeds=negative)
        batch = 1
    video = pipe(image=Image.fromarray(image), **prompt, height=height, width=width, num_frames=frames,
                 num_inference_steps=steps, guidance_scale=guidance_scale, num_videos_per_prompt=batch,
                 generator=torch.Generator().manual_seed(seed), output_type="np", **extra).frames
    return (video * 255).round().astype(np.uint8)


def request(image, *, frames, height, width, steps, guidance_scale, seed, batch=1, **extra) -> GenerationRequest:
    return GenerationRequest(PROMPT, height, width, steps=steps, guidance_scale=guidance_scale, seed=seed,
                             frames=frames, batch=batch, init_image=image, **extra)


@pytest.mark.parametrize("frames,height,width,guidance_scale,batch,cfg_mode", [
    (5, 32, 48, 5.0, 1, "split"),  # non-square
    (9, 32, 32, 1.0, 1, "none"),
    (5, 48, 32, 4.0, 2, "split"),  # two videos: one CLIP and one VAE encode, repeated to the rows
])
def test_wan21_i2v_equals_diffusers(ours, theirs, frames, height, width, guidance_scale, batch, cfg_mode):
    pipe, calls = ours("i2v")
    image = init_image(height, width, seed=frames)
    args = dict(frames=frames, height=height, width=width, steps=3, guidance_scale=guidance_scale, seed=7, batch=batch)
    calls.clear()
    mine = pipe.generate(request(image, **args))
    reference = run_theirs(theirs("i2v"), image, **args)
    assert mine.images.shape == reference.shape == (batch, frames, height, width, 3)
    assert mine.cfg_mode == cfg_mode
    np.testing.assert_array_equal(mine.images, reference)
    cfg = cfg_mode == "split"
    assert calls == {"text_encoder": 2 if cfg else 1, "image_encoder": 1, "vae_encoder": 1,
                     "transformer": 3 * (2 if cfg else 1), "vae_decoder": 1}
    timings = mine.timings
    assert len(timings.step_s) == 3 and timings.image_encode_s > 0 and timings.vae_decode_s > 0
    assert timings.total_s > timings.image_encode_s + sum(timings.step_s)


@pytest.mark.parametrize("frames,height,width,guidance_scale,guidance_scale_2,batch", [
    (5, 32, 48, 4.0, 2.5, 1),  # the low-noise expert's own guidance
    (9, 32, 32, 5.0, None, 1),  # guidance_scale_2 defaults to guidance_scale
    (5, 48, 32, 1.0, None, 2),  # no CFG, two videos (num_videos_per_prompt: no image embeds to mis-repeat)
])
def test_wan22_i2v_two_experts_equal_diffusers(ours, theirs, frames, height, width, guidance_scale,
                                               guidance_scale_2, batch):
    """4 steps of UniPC are timesteps 999, 900, 750, 500: boundary 0.875 x 1000 gives two to each expert."""
    pipe, calls = ours("i2v_two_expert")
    image = init_image(height, width, seed=frames + 1)
    args = dict(frames=frames, height=height, width=width, steps=4, guidance_scale=guidance_scale, seed=3, batch=batch)
    calls.clear()
    mine = pipe.generate(request(image, guidance_scale_2=guidance_scale_2, **args))
    reference = run_theirs(theirs("i2v_two_expert"), image, guidance_scale_2=guidance_scale_2, **args)
    assert mine.images.shape == (batch, frames, height, width, 3)
    np.testing.assert_array_equal(mine.images, reference)
    per_step = 2 if guidance_scale > 1 else 1
    assert calls["transformer"] == calls["transformer_2"] == 2 * per_step
    assert calls["vae_encoder"] == 1 and "image_encoder" not in calls  # Wan 2.2 I2V has no CLIP tower


@pytest.mark.slow
def test_a_long_unipc_schedule_equals_diffusers_and_runs_where_diffusers_fails(ours, theirs):
    """WanImageToVideoPipeline leaves the scheduler's begin index unset (WanPipeline sets 0): its first step looks
    the index up from t, which is 0 until the first timestep repeats — from 334 UniPC steps at flow_shift 3 (999,
    999, ...) it takes the second and its last step overruns the schedule. The loop sets 0: diffusers' video up to
    333 steps, and a video where diffusers fails (1-2 min on two cores: 667 tiny transformer calls)."""
    pipe, _ = ours("i2v")
    image = init_image(16, 16)
    args = dict(frames=1, height=16, width=16, steps=333, guidance_scale=1.0, seed=0)
    np.testing.assert_array_equal(pipe.generate(request(image, **args)).images, run_theirs(theirs("i2v"), image, **args))
    args["steps"] = 334
    with pytest.raises(AssertionError):  # UniPC's `assert self.this_order > 0`
        run_theirs(theirs("i2v"), image, **args)
    assert pipe.generate(request(image, **args)).images.shape == (1, 1, 16, 16, 3)


def test_the_first_frame_conditions_the_clip(ours):
    """Another image gives another clip from the same seed (the condition is not ignored somewhere)."""
    pipe, _ = ours("i2v")
    args = dict(frames=5, height=32, width=32, steps=2, guidance_scale=1.0, seed=1)
    one = pipe.generate(request(init_image(32, 32, seed=1), **args)).images
    two = pipe.generate(request(init_image(32, 32, seed=2), **args)).images
    assert not np.array_equal(one, two)


def test_cfg_parallel_equals_diffusers(reference, theirs):
    """cfg: parallel runs split's two calls at once, image embeds in both: still diffusers' video bit for bit."""
    folder, table = reference("i2v")
    pipe = EnginePipeline(folder, "wan", table, cfg=("parallel",))
    image = init_image(32, 32, seed=4)
    args = dict(frames=5, height=32, width=32, steps=2, guidance_scale=5.0, seed=4)
    mine = pipe.generate(request(image, **args))
    assert mine.cfg_mode == "parallel"
    np.testing.assert_array_equal(mine.images, run_theirs(theirs("i2v"), image, **args))


def test_batch_two_engines_run_cfg_batched_with_the_embeds_twice(reference, theirs):
    """Engines of batch 2 alone: both halves in one call, the image embeds concatenated like the text states;
    not bit-exact (a batch-2 call rounds differently), within a few levels of diffusers' video."""
    folder, table = reference("i2v")
    calls = Counter()
    pipe = EnginePipeline(folder, "wan", counted(table, calls, batch={"transformer": 2}))
    image = init_image(32, 32, seed=5)
    args = dict(frames=5, height=32, width=32, steps=2, guidance_scale=5.0, seed=4)
    mine = pipe.generate(request(image, **args))
    assert mine.cfg_mode == "batched" and calls["transformer"] == 2
    difference = np.abs(mine.images.astype(int) - run_theirs(theirs("i2v"), image, **args))
    assert difference.max() <= 4 and difference.mean() < 0.1


def test_steps_call_back_and_a_raise_cancels_between_steps(ours):
    pipe, calls = ours("i2v")
    seen = []

    def on_step(index, total, latents):
        seen.append((index, total, tuple(latents[0].shape)))

    pipe.generate(request(init_image(32, 32), frames=9, height=32, width=32, steps=3, guidance_scale=5.0, seed=1),
                  on_step)
    assert seen == [(i, 3, (1, 16, 3, 4, 4)) for i in range(3)]  # the latents, not the 36-channel input

    class Cancelled(Exception):
        pass

    def cancel(index, total, latents):
        raise Cancelled

    calls.clear()
    with pytest.raises(Cancelled):
        pipe.generate(request(init_image(32, 32), frames=5, height=32, width=32, steps=5, guidance_scale=5.0,
                              seed=1), cancel)
    assert calls["transformer"] == 2 and calls["vae_decoder"] == 0


def test_an_i2v_checkpoint_serves_img2vid_alone(ours, reference):
    assert [w.value for w in ours("i2v")[0].workflows] == ["img2vid"]
    assert [w.value for w in ours("i2v_two_expert")[0].workflows] == ["img2vid"]
    folder, table = reference("i2v")
    without_clip = EnginePipeline(folder, "wan", RunnerTable([e for e in table.entries
                                                              if e.component != "image_encoder"]))
    assert without_clip.workflows == ()
    with pytest.raises(RuntimeInputError, match=r"WORKFLOW img2vid is not served: it runs image_encoder and "
                                                r"vae_encoder on INIT_IMAGE, but no image_encoder runner is served"):
        without_clip.validate(request(init_image(32, 32), frames=5, height=32, width=32, steps=2,
                                      guidance_scale=5.0, seed=0))


FIELDS = dict(frames=5, height=32, width=32, steps=2, guidance_scale=5.0, seed=0)
NO_IMAGE = ("WORKFLOW txt2img is not served: this WanImageToVideoPipeline checkpoint makes a clip from its first frame "
            "(its transformer takes the image's latents beside the noise): give INIT_IMAGE (served: img2vid)")


@pytest.mark.parametrize("change,message", [  # each request's whole answer (several problems are joined by "; ")
    ({"init_image": None, "workflow": "img2vid"}, "WORKFLOW img2vid needs INIT_IMAGE"),
    ({"init_image": None}, NO_IMAGE),  # a text-only request: txt2img, which this checkpoint cannot run
    ({"init_image": init_image(32, 48)}, "INIT_IMAGE is [32, 48, 3], expected [32, 32, 3] (the request's size; "
                                         "images are not resized)"),
    ({"mask": np.zeros((32, 32), np.uint8)}, "WORKFLOW inpaint (a MASK asks for inpaint) is not served: the wan "
                                             "family has no inpaint workflow (served: img2vid)"),
    ({"mask": np.zeros((32, 32), np.uint8), "workflow": "img2vid"}, "WORKFLOW img2vid takes no MASK"),
    ({"strength": 0.5}, "WORKFLOW img2vid takes no STRENGTH"),
    ({"frames": 0}, "WORKFLOW img2img is not served: the wan family has no img2img workflow (served: img2vid); "
                    "FRAMES must be 4k+1 for the wan family (its VAE packs 4 frames into each latent frame after "
                    "the first), got 0"),  # FRAMES 0 is an image request: its INIT_IMAGE asks for img2img
])
def test_bad_img2vid_requests_are_refused_by_name(ours, change, message):
    fields = {**FIELDS, "init_image": init_image(32, 32), **change}
    image = fields.pop("init_image")
    with pytest.raises(RuntimeInputError) as err:
        ours("i2v")[0].validate(request(image, **fields))
    assert str(err.value) == message


def test_a_text_to_video_checkpoint_refuses_img2vid(tiny_model_factory):
    pipe = EnginePipeline(tiny_model_factory("wan"), "wan", RunnerTable())
    assert [w.value for w in pipe.workflows] == ["txt2img"]
    with pytest.raises(RuntimeInputError) as err:
        pipe.validate(request(init_image(32, 32), **FIELDS))
    assert str(err.value) == ("WORKFLOW img2vid is not served: img2vid needs an image-to-video checkpoint "
                              "(WanImageToVideoPipeline), this one is WanPipeline, whose transformer takes no image "
                              "(served: txt2img)")


def test_an_image_family_reads_an_init_image_as_img2img_still(tiny_model_factory):
    """FRAMES 0 (an image): an INIT_IMAGE still means img2img; img2vid only for a video request."""
    assert GenerationRequest(PROMPT, 64, 64, init_image=init_image(64, 64)).resolved_workflow.value == "img2img"
    assert GenerationRequest(PROMPT, 32, 32, init_image=init_image(32, 32), frames=5).resolved_workflow.value == \
        "img2vid"
    assert GenerationRequest(PROMPT, 32, 32, frames="5").resolved_workflow.value == "txt2img"  # FRAMES named apart
