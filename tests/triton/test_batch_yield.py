"""Interactive before batch inside the entry (issue 46): a running job's request yields between engine calls while a
person's request runs on another instance of the pipeline.

- The registry (backend/activity.py) across real processes: one marks a person's request in flight, another sees
  it; a process that ended (a zombie, then reaped) with its mark still written counts as none.
- The pause, through the backend's own pieces (BlsRunner, RequestContext, serve_batch) with an injected wait
  instead of sleeping (no timing asserted): a job's request does not make its next engine call while another
  instance's mark is there, and makes it once the mark is cleared; cancelled while paused, it raises the
  cancellation; a person's request (or a batch holding one) never reads the marks; the entry runs the people's
  batches of an execute first, publishes the people of the batch it is running, and nothing once it has answered.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from api_waits import until

from trt_diffusion.tensors import TensorSpec
from trt_diffusion.triton.backend import pb
from trt_diffusion.triton.backend.activity import Activity, process_alive
from trt_diffusion.triton.backend.bls import BlsRunner, RequestCancelled, RequestContext
from trt_diffusion.triton.contract import PRIORITY_BATCH_VALUE, PRIORITY_PARAMETER
from trt_diffusion.triton.description import EngineEntry

GUARD_S = 60
NOT_A_PROCESS = 2**22 + 7  # this test's "own" instance pid where the reader must be another pid than the marker


# --- the registry across processes -------------------------------------------------------------------------------


def _person(folder: str, marked, release, clear: bool) -> None:
    """Another instance: marks one person's request running; clears it when released (else ends with it set)."""
    activity = Activity(Path(folder))
    activity.publish(1)
    marked.set()
    if clear:
        release.wait(GUARD_S)
        release.clear()
        activity.publish(0)
        marked.clear()
        release.wait(GUARD_S)  # alive, its count 0
    os._exit(0)  # no cleanup: a crash leaves its file behind


def test_another_process_sees_a_persons_request_in_flight(tmp_path):
    context = multiprocessing.get_context("fork")
    marked, release = context.Event(), context.Event()
    child = context.Process(target=_person, args=(str(tmp_path), marked, release, True))
    child.start()
    try:
        reader = Activity(tmp_path)
        assert marked.wait(GUARD_S)
        assert reader.others_busy() == 1
        reader.publish(1)  # its own mark is not another's
        assert reader.others_busy() == 1
        release.set()
        until(lambda: not marked.is_set(), "the child clearing its mark")
        assert reader.others_busy() == 0
        assert (tmp_path / str(child.pid)).read_text().split() == [str(child.pid), "0"]
        release.set()
    finally:
        child.join(GUARD_S)


def test_a_mark_left_by_a_process_that_ended_counts_as_none(tmp_path):
    context = multiprocessing.get_context("fork")
    marked, release = context.Event(), context.Event()
    child = context.Process(target=_person, args=(str(tmp_path), marked, release, False))
    child.start()
    reader = Activity(tmp_path)
    assert marked.wait(GUARD_S)
    mark = tmp_path / str(child.pid)
    assert mark.read_text().split() == [str(child.pid), "1"]  # left behind
    until(lambda: not process_alive(child.pid), "the child ending")  # not reaped yet: a zombie
    assert reader.others_busy() == 0
    assert not mark.exists()  # removed by the reader
    child.join(GUARD_S)
    mark.write_text(f"{child.pid} 1\n")  # reaped: the pid is no process
    assert reader.others_busy() == 0


def test_servers_do_not_see_each_others_instances_and_gone_servers_are_removed(tmp_path):
    here = Activity.for_server("sd15", server_pid=os.getpid(), root=tmp_path)
    other_server = Activity(tmp_path / str(os.getppid()) / "sd15", pid=NOT_A_PROCESS)
    gone = tmp_path / str(NOT_A_PROCESS) / "sd15"
    gone.mkdir(parents=True)
    here.publish(1)
    assert other_server.others_busy() == 0
    Activity.for_server("sd15", server_pid=os.getpid(), root=tmp_path)
    assert not gone.parent.exists()


# --- the pause, in the backend's pieces --------------------------------------------------------------------------


class Request:
    def __init__(self, parameters: dict | None = None, tensors: dict | None = None):
        self._parameters = json.dumps(parameters or {})
        self.tensors = tensors or {}
        self.cancelled = False

    def parameters(self):
        return self._parameters

    def is_cancelled(self):
        return self.cancelled


def job(**tensors) -> Request:
    return Request({PRIORITY_PARAMETER: PRIORITY_BATCH_VALUE, "trt_diffusion_sent_ns": 1}, tensors)


class Recorder:
    def __init__(self):
        self.added: dict[str, float] = {}

    def add(self, name, value=1.0, **labels):
        self.added[name] = self.added.get(name, 0.0) + value
        assert labels == {"model": "entry"}

    def observe(self, *args, **kwargs):
        pass


class FakeUtils:
    """The python backend's utils a BlsRunner uses: its engine call runs numpy (y = x + 1) and is recorded."""

    calls: list = []

    @staticmethod
    def Tensor(name, value):  # noqa: N802 - the backend's name
        return SimpleNamespace(name=name, value=value, as_numpy=lambda: value)

    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs, parameters=None):
            self.inputs = {t.name: t.value for t in inputs}

        def exec(self):
            FakeUtils.calls.append(self.inputs)
            y = self.inputs["x"] + 1
            return SimpleNamespace(has_error=lambda: False, outputs={"y": y})

    @staticmethod
    def get_output_tensor_by_name(response, name):
        value = response.outputs[name]
        return SimpleNamespace(as_numpy=lambda: value)


@pytest.fixture
def engine(monkeypatch):
    FakeUtils.calls = []
    monkeypatch.setattr(pb, "utils", lambda: FakeUtils)
    spec = TensorSpec("float32", (1, 4), name="x")
    return EngineEntry(model="unet", component="unet", bucket=None, batch=1, controlnet=None, inputs=(spec,),
                       outputs=(TensorSpec("float32", (1, 4), name="y"),))


@pytest.fixture
def instances(tmp_path):
    """Two instances of one pipeline: `person`, this process (a live pid), and `mine`, whose context serves."""
    person = Activity(tmp_path)
    mine = Activity(tmp_path, pid=NOT_A_PROCESS)
    context = RequestContext()
    context.activity, context.metrics, context.model = mine, Recorder(), "entry"
    return SimpleNamespace(person=person, mine=mine, context=context)


def feeds():
    return {"x": np.zeros((1, 4), np.float32)}


def test_a_job_makes_no_engine_call_while_a_person_runs_on_another_instance(engine, instances):
    context, person = instances.context, instances.person
    context.requests = [job(), job()]
    person.publish(1)
    calls_at_each_wait = []

    def wait(seconds):
        calls_at_each_wait.append(len(FakeUtils.calls))
        if len(calls_at_each_wait) == 3:
            person.publish(0)  # the person's request answered

    context.wait = wait
    out = BlsRunner(engine, context).run(feeds())
    assert calls_at_each_wait == [0, 0, 0]  # held back until the mark was cleared
    assert len(FakeUtils.calls) == 1 and out["y"].tolist() == [[1.0] * 4]
    assert context.metrics.added["batch_yields_total"] == 1
    assert context.metrics.added["batch_yield_seconds_total"] >= 0
    BlsRunner(engine, context).run(feeds())  # nobody busy: straight through
    assert len(calls_at_each_wait) == 3 and len(FakeUtils.calls) == 2


def test_a_job_cancelled_while_it_waits_raises_the_cancellation(engine, instances):
    context = instances.context
    request = job()
    context.request = request  # a stream's request (the entry's batch: context.requests)
    instances.person.publish(2)
    waits = []

    def wait(seconds):
        waits.append(seconds)
        if len(waits) == 2:
            request.cancelled = True  # the API deleted the video / cancelled the batch

    context.wait = wait
    with pytest.raises(RequestCancelled) as raised:
        BlsRunner(engine, context).run(feeds())
    assert raised.value.requests == [request]
    assert FakeUtils.calls == [] and len(waits) == 2
    assert context.metrics.added["batch_yields_total"] == 1


class NeverRead:
    def others_busy(self):
        raise AssertionError("a person's request read the other instances' marks")

    def publish(self, count):
        pass


@pytest.mark.parametrize("requests", [[Request()], [job(), Request()]], ids=["person", "person beside a job"])
def test_a_persons_request_never_waits(engine, instances, requests):
    context = instances.context
    context.activity = NeverRead()
    context.requests = requests

    def wait(seconds):
        raise AssertionError("a person's request waited")

    context.wait = wait
    BlsRunner(engine, context).run(feeds())
    assert len(FakeUtils.calls) == 1 and context.metrics.added == {}


def test_a_single_instance_never_waits(engine, tmp_path):
    context = RequestContext()
    context.activity = Activity(tmp_path)  # alone in its pipeline's folder
    context.requests = [job()]
    context.wait = lambda seconds: pytest.fail("a job waited with no other instance")
    BlsRunner(engine, context).run(feeds())
    assert len(FakeUtils.calls) == 1


def test_the_entry_publishes_the_people_of_the_batch_it_runs(tmp_path, monkeypatch):
    """serve_batch over a job's request and a person's in one execute (two denoising batches): the person's runs
    first (the job's may be held: the person must not wait behind it), and while it runs another instance reads 1;
    while the job's runs, 0; after the answers, 0."""
    from trt_diffusion.runtime.pipeline import Generation, StageTimings
    from trt_diffusion.triton.backend import batching
    from trt_diffusion.triton.client import ImageRequest

    monkeypatch.setattr(pb, "utils", lambda: SimpleNamespace(
        Tensor=lambda name, value: (name, value),
        InferenceResponse=lambda tensors=(), error=None, parameters=None: SimpleNamespace(tensors=tensors,
                                                                                             error=error)))
    monkeypatch.setattr(pb, "input_array", lambda request, name: request.tensors.get(name))
    seen = []
    context = RequestContext()
    context.activity = Activity(tmp_path)  # the entry's instance (this process)
    other = Activity(tmp_path, pid=NOT_A_PROCESS)  # another instance of the pipeline

    class Pipeline:
        def plan_batches(self, requests):
            return {}, [[i] for i in range(len(requests))]

        def generate_together(self, requests, on_step=None):
            seen.append((requests[0].prompt, other.others_busy()))
            return [Generation(np.zeros((1, 8, 8, 3), np.uint8), StageTimings(batch=1), "none") for _ in requests]

    def tensors(prompt):
        return ImageRequest(prompt=prompt, height=8, width=8, steps=2, guidance_scale=7.5, seed=1).tensors()

    requests = [job(**tensors("job")), Request(tensors=tensors("person"))]
    responses = batching.serve_batch("entry", Pipeline(), context, requests, 1)
    assert [r.error for r in responses] == [None, None]
    assert seen == [("person", 1), ("job", 0)]  # the person's batch first, though Triton handed the job first
    assert other.others_busy() == 0
