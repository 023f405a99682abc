"""Interactive before batch on the real tritonserver (issue 46): a job's request (the request parameter
trt_diffusion_priority=batch, as the OpenAI API's jobs send it) held back by the entry while another instance of the
pipeline runs a person's request, and going on, to the same image, once that is done.

The "person on another instance" is a mark this test writes where the entry's instances publish theirs
(backend/activity.py: the server's folder for the pipeline), held by this live process, so the hold is an event, not a
timing: while the mark is there the job cannot finish (a person's request sent after it, on the other instance,
finishes first: it never waits); cleared, the job finishes with the image a person's identical request gets; the
entry counts one pause (trt_diffusion_batch_yields_total). Slow: the sd15 tiny engines packaged and the server
started with two entry instances.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request

import numpy as np
import pytest

from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton import stage
from trt_diffusion.triton.backend.activity import Activity, root_folder
from trt_diffusion.triton.client import ImageRequest
from trt_diffusion.triton.contract import PRIORITY_BATCH_VALUE, PRIORITY_PARAMETER

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(900)]

SIZE = 64
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def served(sd15_engines, tmp_path_factory):
    from trt_diffusion.triton.repository import PackageOptions, package

    root = tmp_path_factory.mktemp("batch-yield")
    # one request an execute: the job and the person never share one, so each has an instance of its own (in one
    # execute the person's would wait behind the held job)
    options = PackageOptions(pipeline_instances=2, max_queue_size=8, queue_timeout_s=60, batch_requests=1)
    report = package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name,
                     root / "repo", options)
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=True, protocol="grpc")
    try:
        yield server, report, root / "repo"
    finally:
        server.stop()


def metric(server, name: str, model: str) -> float:
    url = f"http://127.0.0.1:{server.ports.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf'^{name}{{model="{re.escape(model)}"}} ([0-9.e+-]+)', text, re.MULTILINE)
    return 0.0 if match is None else float(match.group(1))


def test_a_job_waits_while_a_person_runs_on_another_instance_then_gives_its_image(served):
    import tritonclient.grpc as grpc

    server, report, repo = served
    pipeline = json.loads((repo / report.entry / "1" / "pipeline.json").read_text())["pipeline"]
    folder = root_folder() / str(server.process.pid) / pipeline  # made by the instances (the stubs' parent)
    assert folder.is_dir(), f"the entry's instances publish nowhere: {sorted(folder.parent.parent.iterdir())}"
    person = Activity(folder)  # this live process: "another instance" of the pipeline
    request = ImageRequest(prompt="a lighthouse", height=SIZE, width=SIZE, steps=3, guidance_scale=7.5, seed=5)
    inputs = triton_client.make_inputs(grpc, request.tensors())
    outputs = [grpc.InferRequestedOutput("IMAGE")]
    done, answers = threading.Event(), []

    def answered(result, error):
        answers.append(error if error is not None else result.as_numpy("IMAGE"))
        done.set()

    job_client, person_client = grpc.InferenceServerClient(server.grpc_url), grpc.InferenceServerClient(server.grpc_url)
    try:
        person.publish(1)
        job_client.async_infer(report.entry, inputs, outputs=outputs, callback=answered,
                               parameters={PRIORITY_PARAMETER: PRIORITY_BATCH_VALUE}, client_timeout=HANG_GUARD_S)
        alone = person_client.infer(report.entry, inputs, outputs=outputs).as_numpy("IMAGE")  # never waits
        assert not done.is_set(), f"the job was answered while a person's request ran elsewhere: {answers}"
        assert metric(server, "trt_diffusion_batch_yields_total", report.entry) == 0  # still held
        person.publish(0)
        assert done.wait(HANG_GUARD_S), "the job never went on"
    finally:
        person.close()
        job_client.close()
        person_client.close()
    (image,) = answers
    assert isinstance(image, np.ndarray), image
    assert np.array_equal(image, alone)  # held, not changed
    assert metric(server, "trt_diffusion_batch_yields_total", report.entry) == 1
    assert metric(server, "trt_diffusion_batch_yield_seconds_total", report.entry) > 0
