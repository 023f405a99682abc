"""generate_batch: requests sharing a batch key run through shared denoiser calls, each image equal to the
request's image alone; different keys are grouped apart; bad requests fail alone; groups are split over the
engine batches there are."""

from __future__ import annotations

from dataclasses import replace

import pytest
from batch_rounding import assert_same_image

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest, _split_rows
from trt_diffusion.runtime.reference import reference_runners

PROMPTS = ["a lighthouse on a cliff at dusk", "a red fox in snow", "an old tram in Lisbon", "a bowl of ramen"]


class Counting:
    """A runner wrapper counting calls and the batch of each call."""

    def __init__(self, runner, calls: list):
        self.runner, self.calls = runner, calls
        self.inputs = runner.inputs
        self.name = getattr(runner, "name", "runner")

    def run(self, feeds):
        self.calls.append(next(iter(feeds.values())).shape[0])
        return self.runner.run(feeds)


@pytest.fixture(scope="module")
def sd15(tiny_model_factory):
    folder = tiny_model_factory("sd15")
    runners = reference_runners(folder, "sd15")
    calls: list[int] = []
    runners.entries = [replace(e, runner=Counting(e.runner, calls)) if e.component == "unet" else e
                       for e in runners.entries]
    return EnginePipeline(folder, "sd15", runners), calls


def request(i: int, **change) -> GenerationRequest:
    values = dict(prompt=PROMPTS[i % len(PROMPTS)], height=64, width=64, steps=3, guidance_scale=5.0 + i, seed=10 + i)
    values.update(change)
    return GenerationRequest(**values)


def test_batched_images_equal_their_unbatched_images(sd15):
    pipe, calls = sd15
    requests = [request(i, negative_prompt="blurry" if i % 2 else None) for i in range(4)]
    alone = [pipe.generate(r).images for r in requests]
    calls.clear()
    together = pipe.generate_batch(requests)
    assert calls == [8] * 3  # one call per step, 4 requests x 2 (CFG) rows
    for single, generation in zip(alone, together):
        assert_same_image(generation.images, single)
        assert generation.timings.batch == 4 and len(generation.timings.step_s) == 3


def test_keys_group_right_and_bad_requests_fail_alone(sd15):
    pipe, calls = sd15
    requests = [request(0), request(1, scheduler="euler"), request(2), request(3, steps=0),
                request(0, guidance_scale=1.0), request(1, scheduler="euler")]
    errors, batches = pipe.plan_batches(requests)
    assert set(errors) == {3} and "STEPS" in str(errors[3])
    assert sorted(map(sorted, batches)) == [[0, 2], [1, 5], [4]]
    results = pipe.generate_batch(requests)
    assert isinstance(results[3], RuntimeInputError)
    for i in (0, 1, 2, 4, 5):
        assert_same_image(results[i].images, pipe.generate(requests[i]).images)


def test_groups_split_over_the_engine_batches_there_are():
    assert _split_rows([1, 1, 1], {1, 2}, ["a", "b", "c"]) == [["a", "b"], ["c"]]
    assert _split_rows([1] * 7, {1, 2, 4}, list(range(7))) == [[0, 1, 2, 3], [4, 5], [6]]
    assert _split_rows([1, 1, 1], {1, 4}, [0, 1, 2]) == [[0], [1], [2]]
    assert _split_rows([2, 1, 1], {1, 2}, [0, 1, 2]) == [[0], [1, 2]]
    assert _split_rows([3], {1, 2}, [0]) == [[0]]  # no engine takes it: alone, to fail with its own message
    assert _split_rows([1] * 9, None, list(range(9))) == [list(range(8)), [8]]
