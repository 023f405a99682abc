"""The API process SIGKILLed in the middle of a batch and started again on the same state folder finishes the batch:
no line lost, none run twice, each line's stored seed reproducing its image; a batch finished before the kill
stays downloadable. The API runs as the real CLI in a child process, in front of the stand-in Triton of
tests/shared/images_stub_triton.py, whose gate holds inferences so the kill lands at a known line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from api_waits import GUARD_S, png_pixels, stop_process, until
from images_stub_triton import expected_image, start_images_stub

from trt_diffusion.triton.server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "restart-key"


def start_api(stub, state, port) -> subprocess.Popen:
    env = dict(os.environ, TRT_DIFFUSION_API_KEY=KEY)
    return subprocess.Popen([sys.executable, "-m", "trt_diffusion", "openai-api", "--triton-url", stub.url,
                             "--port", str(port), "--state-dir", str(state)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def client(port: int):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=10)


def upload_batch(openai_client, lines: list[dict]):
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = openai_client.files.create(file=("jobs.jsonl", content), purpose="batch")
    return openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                        completion_window="24h")


def line(i: int, seeded: bool) -> dict:
    body = {"model": "sd15-tiny", "prompt": f"asset {i}", "num_inference_steps": 3}
    if seeded:
        body["seed"] = 500 + i
    return {"custom_id": f"asset-{i}", "method": "POST", "url": "/v1/images/generations", "body": body}


def test_a_batch_interrupted_by_sigkill_finishes_after_a_restart(tmp_path):
    stub = start_images_stub()
    stub.gate = threading.Semaphore(0)
    state, port = tmp_path / "state", free_port()
    process = start_api(stub, state, port)
    try:
        openai_client = client(port)
        until(lambda: openai_client.batches.list() is not None, "the API listening", process)
        stub.gate.release(2)
        earlier = upload_batch(openai_client, [line(100, True), line(101, False)])
        earlier = until(lambda: (b := openai_client.batches.retrieve(earlier.id)).status == "completed" and b,
                        "the first batch completing", process)
        earlier_output = openai_client.files.content(earlier.output_file_id).content
        batch = upload_batch(openai_client, [line(i, seeded=i % 2 == 0) for i in range(8)])
        stub.gate.release(3)
        until(lambda: stub.arrivals == 2 + 4, "the fourth line reaching Triton", process)  # lines 1-3 answered
        process.send_signal(signal.SIGKILL)
        process.wait(GUARD_S)
        assert stub.cancelled.wait(GUARD_S)  # the killed process's call went with it, unanswered

        process = start_api(stub, state, port)  # a new process on the same folder
        until(lambda: openai_client.batches.list() is not None, "the API listening again", process)
        stub.gate.release(100)
        done = until(lambda: (b := openai_client.batches.retrieve(batch.id)).status == "completed" and b,
                     "the batch completing after the restart", process)
        assert done.request_counts.total == 8 and done.request_counts.completed == 8
        records = [json.loads(x) for x in openai_client.files.content(done.output_file_id).text.splitlines()]
        assert [r["custom_id"] for r in records] == [f"asset-{i}" for i in range(8)]  # none lost, none doubled
        prompts = {f"asset {i}" for i in range(8)}
        ran = [(prompt, seed) for _, prompt, seed in stub.infers if prompt in prompts]
        assert sorted(ran) == sorted(set(ran)) and len(ran) == 8  # each line answered once
        sent = {(prompt, seed) for _, prompt, seed in stub.arrived if prompt in prompts}
        assert len(sent) == 8  # the line the kill interrupted went again with its stored seed, not a new one
        for i, record in enumerate(records):
            (item,) = record["response"]["body"]["data"]
            if i % 2 == 0:
                assert item["seed"] == 500 + i
            expected = expected_image("sd15-tiny", f"asset {i}", item["seed"], 64, 64, 3)
            assert np.array_equal(png_pixels(item["b64_json"]), expected)
        assert openai_client.files.content(earlier.output_file_id).content == earlier_output  # still there
    finally:
        stop_process(process)
        stub.stop()
