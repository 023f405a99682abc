"""The Wan pipeline over the torch-reference runners equals diffusers' own WanPipeline of the same tiny folder, bit
for bit (issue #24): frame counts, non-square sizes, CFG on and off, several videos per prompt, both schedulers,
and Wan 2.2's two experts switched at boundary_ratio. Bad video requests are refused by name."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.runners import CallableRunner
from trt_diffusion.runtime.schedulers import make_scheduler

PROMPT = "a red fox running through  snow &amp; pines\n"  # html entity and whitespace: prompt_clean's work


def counted(table: RunnerTable, calls: Counter, *, batch: dict[str, int] | None = None) -> RunnerTable:
    """The same runners, each call counted by component; `batch` gives components a fixed engine batch."""
    counting = RunnerTable()
    for entry in table.entries:
        def run(feeds, runner=entry.runner, component=entry.component):
            calls[component] += 1
            return runner.run(feeds)

        counting.add(entry.component, CallableRunner(run, entry.runner.inputs, name=entry.runner.name),
                     batch=(batch or {}).get(entry.component))
    return counting


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """`reference(variant) -> (folder, RunnerTable)`: the torch runners, loaded once per module."""
    cache = {}

    def get(variant: str | None = None):
        if variant not in cache:
            folder = tiny_model_factory("wan", variant=variant)
            cache[variant] = (folder, reference_runners(folder, "wan"))
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def ours(reference):
    """`ours(variant) -> (EnginePipeline, Counter of runner calls)`; the pipeline holds no request state, so the
    tests share it (each clears the counter it reads)."""
    cache = {}

    def get(variant: str | None = None):
        if variant not in cache:
            folder, table = reference(variant)
            calls = Counter()
            cache[variant] = (EnginePipeline(folder, "wan", counted(table, calls)), calls)
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def theirs(tiny_model_factory):
    cache = {}

    def get(variant: str | None = None):
        if variant not in cache:
            pipe = WanPipeline.from_pretrained(tiny_model_factory("wan", variant=variant))
            pipe.set_progress_bar_config(disable=True)
            cache[variant] = (pipe, dict(pipe.scheduler.config))
        return cache[variant]

    return get


def run_theirs(loaded, *, frames, height, width, steps, guidance_scale, seed, batch=1, scheduler=None, **extra):
    pipe, scheduler_config = loaded
    pipe.scheduler = scheduler or make_scheduler("default", scheduler_config, "wan")
    video = pipe(PROMPT, num_frames=frames, height=height, width=width, num_inference_steps=steps,
                 guidance_scale=guidance_scale, num_videos_per_prompt=batch,
                 generator=torch.Generator().manual_seed(seed), output_type="np",
                 **extra).frames  # max_sequence_length: __call__'s default, the engines' text length
    return (video * 255).round().astype(np.uint8)


def request(*, frames, height, width, steps, guidance_scale, seed, batch=1, **extra) -> GenerationRequest:
    return GenerationRequest(PROMPT, height, width, steps=steps, guidance_scale=guidance_scale, seed=seed,
                             frames=frames, batch=batch, **extra)


@pytest.mark.parametrize("frames,height,width,guidance_scale,batch,cfg_mode", [
    (5, 32, 32, 5.0, 1, "split"),
    (9, 32, 32, 5.0, 1, "split"),
    (5, 32, 48, 1.0, 1, "none"),  # non-square, no CFG: one transformer call per step
    (9, 48, 32, 4.0, 2, "split"),  # two videos per prompt: one encoder call repeated, noise [2, ...]
    (5, 32, 32, 1.0, 2, "none"),
])
def test_wan_equals_diffusers(ours, theirs, frames, height, width, guidance_scale, batch, cfg_mode):
    pipe, calls = ours()
    args = dict(frames=frames, height=height, width=width, steps=3, guidance_scale=guidance_scale, seed=7, batch=batch)
    calls.clear()
    mine = pipe.generate(request(**args))
    reference = run_theirs(theirs(), **args)
    assert mine.images.shape == reference.shape == (batch, frames, height, width, 3)
    assert mine.cfg_mode == cfg_mode
    np.testing.assert_array_equal(mine.images, reference)
    cfg = cfg_mode == "split"
    assert calls == {"text_encoder": 2 if cfg else 1, "transformer": 3 * (2 if cfg else 1), "vae_decoder": 1}
    timings = mine.timings
    assert len(timings.step_s) == 3 and timings.text_encode_s > 0 and timings.vae_decode_s > 0


def test_negative_prompt_equals_diffusers(ours, theirs):
    args = dict(frames=5, height=32, width=32, steps=2, guidance_scale=6.0, seed=3)
    negative = "blurry, <b>static</b>"
    mine = ours()[0].generate(request(negative_prompt=negative, **args)).images
    np.testing.assert_array_equal(mine, run_theirs(theirs(), negative_prompt=negative, **args))
    assert not np.array_equal(mine, ours()[0].generate(request(**args)).images)  # "" is the default negative


def test_flow_euler_equals_diffusers_flow_match_scheduler(ours, theirs):
    """`flow_euler` on Wan is FlowMatchEulerDiscreteScheduler(shift=flow_shift), the one diffusers' Wan docs name."""
    args = dict(frames=5, height=32, width=32, steps=3, guidance_scale=5.0, seed=5)
    mine = ours()[0].generate(request(scheduler="flow_euler", **args)).images
    reference = run_theirs(theirs(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **args)
    np.testing.assert_array_equal(mine, reference)


@pytest.mark.parametrize("guidance_scale,guidance_scale_2", [(5.0, None), (4.0, 2.5), (1.0, None)])
def test_two_experts_switch_at_the_boundary_as_diffusers(ours, theirs, guidance_scale, guidance_scale_2):
    """4 steps of UniPC are timesteps 999, 900, 750, 500: boundary 0.875 x 1000 gives the first two to `transformer`
    (guidance_scale) and the last two to `transformer_2` (guidance_scale_2, default guidance_scale)."""
    pipe, calls = ours("two_expert")
    args = dict(frames=5, height=32, width=48, steps=4, guidance_scale=guidance_scale, seed=2)
    calls.clear()
    mine = pipe.generate(request(guidance_scale_2=guidance_scale_2, **args)).images
    reference = run_theirs(theirs("two_expert"), guidance_scale_2=guidance_scale_2, **args)
    np.testing.assert_array_equal(mine, reference)
    per_step = 2 if guidance_scale > 1 else 1
    assert calls["transformer"] == calls["transformer_2"] == 2 * per_step


def test_steps_call_back_and_a_raise_cancels_between_steps(ours):
    pipe, calls = ours()
    seen = []

    def on_step(index, total, latents):
        seen.append((index, total, tuple(latents[0].shape)))

    pipe.generate(request(frames=9, height=32, width=32, steps=3, guidance_scale=5.0, seed=1), on_step)
    assert seen == [(i, 3, (1, 16, 3, 4, 4)) for i in range(3)]

    class Cancelled(Exception):
        pass

    def cancel(index, total, latents):
        raise Cancelled

    calls.clear()
    with pytest.raises(Cancelled):
        pipe.generate(request(frames=5, height=32, width=32, steps=5, guidance_scale=5.0, seed=1), cancel)
    assert calls["transformer"] == 2 and calls["vae_decoder"] == 0  # step 0's two calls, then nothing


def test_a_batch_of_wan_requests_each_equals_its_own(ours):
    """generate_batch runs Wan requests one per batch (video_loop.py says why): each video is the one it gets alone."""
    pipe, _ = ours()
    requests = [request(frames=5, height=32, width=32, steps=2, guidance_scale=5.0, seed=s) for s in (1, 2)]
    requests.append(request(frames=6, height=32, width=32, steps=2, guidance_scale=5.0, seed=3))
    assert len({pipe.batch_key(r) for r in requests}) == 3
    together = pipe.generate_batch(requests)
    assert isinstance(together[2], RuntimeInputError) and "got 6" in str(together[2])
    for one, batched in zip(requests[:2], together):
        np.testing.assert_array_equal(pipe.generate(one).images, batched.images)


def test_batch_two_engines_only_run_cfg_batched(reference, theirs):
    """Engines of batch 2 alone: CFG's halves go in one call (not bit-exact: a batch-2 call rounds differently),
    and the video stays within a few levels of diffusers' (1 at most, on 1 value in 15000, here)."""
    folder, table = reference()
    calls = Counter()
    pipe = EnginePipeline(folder, "wan", counted(table, calls, batch={"transformer": 2}))
    args = dict(frames=5, height=32, width=32, steps=2, guidance_scale=5.0, seed=4)
    mine = pipe.generate(request(**args))
    assert mine.cfg_mode == "batched" and calls["transformer"] == 2
    difference = np.abs(mine.images.astype(int) - run_theirs(theirs(), **args))
    assert difference.max() <= 4 and difference.mean() < 0.1


@pytest.mark.parametrize("change,message", [
    ({"frames": 6}, "FRAMES must be 4k+1 for the wan family (its VAE packs 4 frames into each latent frame after "
                    "the first), got 6: use 5 or 9"),
    ({"frames": 0}, "FRAMES must be 4k+1 for the wan family"),
    ({"frames": 5.0}, "FRAMES must be a whole number, got 5.0"),
    ({"width": 40}, "size 40x32x5 is not a positive multiple of 16"),
    ({"guidance_scale_2": 3.0}, "GUIDANCE_SCALE_2 is the low-noise expert's guidance of a two-expert (Wan 2.2) "
                                "model; this model has one denoiser"),
    ({"scheduler": "euler"}, "unknown scheduler 'euler'; choose one of default, unipc, flow_euler"),
])
def test_bad_wan_requests_are_refused_by_name(ours, change, message):
    fields = dict(frames=5, height=32, width=32, steps=2, guidance_scale=5.0, seed=0)
    with pytest.raises(RuntimeInputError) as err:
        ours()[0].validate(request(**{**fields, **change}))
    assert message in str(err.value)


def test_a_two_expert_model_without_its_low_noise_runner_is_refused(reference):
    folder, table = reference("two_expert")
    pipe = EnginePipeline(folder, "wan", RunnerTable([e for e in table.entries if e.component != "transformer_2"]))
    with pytest.raises(RuntimeInputError, match=r"switches to transformer_2 below timestep 875 \(boundary_ratio "
                                                r"0.875\), but no transformer_2 runner is served"):
        pipe.validate(request(frames=5, height=32, width=32, steps=2, guidance_scale=5.0, seed=0))


def test_an_image_family_refuses_frames(tiny_model_factory):
    pipe = EnginePipeline(tiny_model_factory("sd15"), "sd15", RunnerTable())
    with pytest.raises(RuntimeInputError, match=r"FRAMES 5: the sd15 family makes images \(FRAMES is 0 for an "
                                                r"image; video families: wan\)"):
        pipe.validate(GenerationRequest(PROMPT, 64, 64, frames=5))
    with pytest.raises(RuntimeInputError, match="GUIDANCE_SCALE_2 is the low-noise expert's guidance"):
        pipe.validate(GenerationRequest(PROMPT, 64, 64, guidance_scale_2=2.0))


def test_runners_swapped_reaches_the_wan_loop(ours):
    """The Triton entry's python warm-up runs on stand-ins through runners_swapped: the Wan loop must see them
    too (it holds its own reference to the table), and get the real ones back."""
    pipe, _ = ours()
    own, stand_ins = pipe.runners, RunnerTable()
    with pipe.runners_swapped(stand_ins):
        assert pipe.runners is stand_ins and pipe.wan.runners is stand_ins
    assert pipe.runners is own and pipe.wan.runners is own
