"""Interactive before batch: the entries' dynamic batcher has two priority levels (requests that send none are
interactive); the API's job lines and videos are sent at the batch level and marked as jobs' (the request parameter
trt_diffusion_priority=batch, by which the entry makes them yield between steps), its online requests at the default
and unmarked; and a job line
starts only when it leaves one of the model's instances to people (tests/shared/images_stub_triton.py declares the
instance count and holds inferences, so "did not start" is observed, not timed)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from api_waits import until

from trt_diffusion.openai_api.job_slots import BatchPriorityClient, JobSlots
from trt_diffusion.triton import configs
from trt_diffusion.triton.contract import (
    PRIORITY_BATCH_VALUE,
    PRIORITY_PARAMETER,
    REQUEST_INPUTS,
    SENT_NS_PARAMETER,
)

GUARD_S = 60


def test_queued_entries_have_an_interactive_and_a_batch_level():
    config = configs.pipeline_config("e", stage="full", inputs=REQUEST_INPUTS, outputs=[], instances=2,
                                     queue=configs.QueuePolicy(8, 60.0), parameters={})
    batching = config.dynamic_batching
    assert (batching.priority_levels, batching.default_priority_level) == (2, 1)
    assert (configs.PRIORITY_INTERACTIVE, configs.PRIORITY_BATCH) == (1, 2)
    unqueued = configs.pipeline_config("s", stage="encode", inputs=REQUEST_INPUTS, outputs=[], instances=1,
                                       queue=None, parameters={})
    assert not unqueued.HasField("dynamic_batching")


@pytest.mark.parametrize("instances, online, free", [
    (1, 0, True), (1, 1, False), (2, 0, True), (2, 1, False), (3, 1, True), (3, 2, False)])
def test_a_job_leaves_people_an_instance(instances, online, free):
    class Client:
        async def get_model_config(self, model):
            return SimpleNamespace(config=SimpleNamespace(instance_group=[SimpleNamespace(count=instances)]))

    slots = JobSlots(Client())
    for _ in range(online):
        slots.enter("m")
    assert asyncio.run(slots.free("m")) is free


@pytest.fixture
def stub(stub):
    """tests/openai_api/conftest.py's, holding every inference until the test releases it."""
    stub.gate = threading.Semaphore(0)
    return stub


def health(api) -> dict:
    with urllib.request.urlopen(api.url.removesuffix("/v1") + "/health", timeout=10) as response:
        return json.loads(response.read())


def submit(client, prompt: str):
    line = {"custom_id": prompt, "method": "POST", "url": "/v1/images/generations",
            "body": {"model": "sd15-tiny", "prompt": prompt, "seed": 1}}
    upload = client.files.create(file=("a.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                 completion_window="24h")


@pytest.mark.parametrize("instances", [2, 3])
def test_jobs_go_at_batch_priority_and_keep_off_the_last_instance(api, stub, instances):
    import openai

    stub.instances = instances
    client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)
    with ThreadPoolExecutor(1) as pool:
        online = pool.submit(client.images.generate, model="sd15-tiny", prompt="person", extra_body={"seed": 1})
        until(lambda: stub.arrivals == 1, "the online request reaching Triton")
        batch = submit(client, "job")
        if instances == 2:  # the online request holds one of two: the job waits for it
            until(lambda: health(api)["jobs"]["waiting_for_an_instance"], "the job waiting")
            assert stub.arrivals == 1
        else:  # one of three busy: the job takes another and still leaves one
            until(lambda: stub.arrivals == 2, "the job line reaching Triton")
        stub.gate.release(10)
        online.result(GUARD_S)
    until(lambda: client.batches.retrieve(batch.id).status == "completed", "the batch completing")
    assert stub.priorities == {"person": 0, "job": configs.PRIORITY_BATCH}  # online: the default (interactive)
    # and marked as a job's over the wire: the entry holds it back between steps while a person's runs elsewhere
    assert stub.marks == {"person": "", "job": PRIORITY_BATCH_VALUE}
    assert health(api)["jobs"]["waiting_for_an_instance"] is False


def test_a_video_job_goes_at_batch_priority_marked_as_a_job(api, stub):
    import openai

    client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)
    video = client.videos.create(model="wan-tiny", prompt="a clip", size="32x32",
                                 extra_body={"seed": 1, "num_inference_steps": 2})
    stub.gate.release(10)  # this module's stub holds every inference until released
    until(lambda: client.videos.retrieve(video.id).status in ("completed", "failed"), "the video ending")
    assert client.videos.retrieve(video.id).status == "completed", client.videos.retrieve(video.id).error
    assert stub.priorities == {"a clip": configs.PRIORITY_BATCH}
    assert stub.marks == {"a clip": PRIORITY_BATCH_VALUE}


class Capture:
    """A stand-in Triton client: records each inference's keyword arguments, answers `result`."""

    def __init__(self, result: np.ndarray):
        self.result, self.calls = result, []

    async def infer(self, model, inputs, **kwargs):
        self.calls.append(kwargs)
        return SimpleNamespace(as_numpy=lambda name: self.result)


def test_the_jobs_client_adds_the_batch_mark_beside_the_callers_parameters():
    from trt_diffusion.openai_api.triton_calls import infer_images
    from trt_diffusion.openai_api.video_routes import infer_video
    from trt_diffusion.triton.client import ImageRequest

    request = ImageRequest(prompt="p", height=8, width=8, steps=2, guidance_scale=1.0, seed=1)
    images = Capture(np.zeros((1, 8, 8, 3), np.uint8))
    asyncio.run(infer_images(BatchPriorityClient(images), "m", request.tensors(), 10.0))
    (kwargs,) = images.calls
    assert kwargs["priority"] == configs.PRIORITY_BATCH
    assert set(kwargs["parameters"]) == {SENT_NS_PARAMETER, PRIORITY_PARAMETER}  # the send time kept
    assert kwargs["parameters"][PRIORITY_PARAMETER] == PRIORITY_BATCH_VALUE
    clips = Capture(np.zeros((1, 5, 8, 8, 3), np.uint8))
    asyncio.run(infer_video(BatchPriorityClient(clips), "v", request.tensors(), 10.0))  # sends no parameters
    assert clips.calls[0]["parameters"] == {PRIORITY_PARAMETER: PRIORITY_BATCH_VALUE}
    online = Capture(np.zeros((1, 8, 8, 3), np.uint8))
    asyncio.run(infer_images(online, "m", request.tensors(), 10.0))  # a person's: unmarked
    assert "priority" not in online.calls[0] and PRIORITY_PARAMETER not in online.calls[0]["parameters"]


def test_the_jobs_client_gives_its_calls_the_job_deadline_not_the_online_one():
    from trt_diffusion.openai_api.triton_calls import infer_images
    from trt_diffusion.openai_api.video_routes import infer_video
    from trt_diffusion.triton.client import ImageRequest

    request = ImageRequest(prompt="p", height=8, width=8, steps=2, guidance_scale=1.0, seed=1)
    images = Capture(np.zeros((1, 8, 8, 3), np.uint8))
    asyncio.run(infer_images(BatchPriorityClient(images, 86400.0), "m", request.tensors(), 600.0))
    assert images.calls[0]["client_timeout"] == 86400.0
    clips = Capture(np.zeros((1, 5, 8, 8, 3), np.uint8))
    asyncio.run(infer_video(BatchPriorityClient(clips, 86400.0), "v", request.tensors(), 600.0))
    assert clips.calls[0]["client_timeout"] == 86400.0


class TestJobDeadline:
    """A job line held in Triton (the entry yielding to people) past the online --timeout completes: job calls have
    their own deadline (--job-timeout, a day by default); an online request held as long still gets its 504."""

    @pytest.fixture
    def api_settings(self) -> dict:
        return {"timeout_s": 1.0}

    def test_a_job_line_held_past_the_online_deadline_completes(self, api, stub):
        import openai

        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)
        with ThreadPoolExecutor(1) as pool:  # online first: the job waits while a person holds the one instance
            online = pool.submit(client.images.generate, model="sd15-tiny", prompt="person", extra_body={"seed": 1})
            with pytest.raises(openai.APIStatusError) as late:
                online.result(GUARD_S)
        assert late.value.status_code == 504
        stub.gate.release(1)  # the person's call, given up by the API, ends in the stand-in too
        batch = submit(client, "job")
        until(lambda: stub.arrivals == 2, "the job line reaching Triton")
        time.sleep(2.0)  # held twice the online deadline
        stub.gate.release(1)
        until(lambda: client.batches.retrieve(batch.id).status == "completed", "the batch completing")
        counts = client.batches.retrieve(batch.id).request_counts
        assert (counts.completed, counts.failed) == (1, 0)
        assert stub.arrivals == 2  # one call: not failed and run again
