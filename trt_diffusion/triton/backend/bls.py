"""BLS runners: the Runner protocol over Triton models, so `EnginePipeline` runs unchanged inside Triton
and calls each engine's model every step; the same pipeline code in process and in the server gives the
same images.

`cfg: parallel` calls one BlsRunner from two threads at once (runtime/cfg_parallel.py): each `exec` is its own
request, which Triton hands to an idle instance of the engine's model, and the denoiser models of a parallel
repository have two (repository.py), so the two CFG halves run side by side in two stub processes (or on two GPUs).
That is what the python backend's `async_exec` does too (Triton 2.51: `exec` on an asyncio executor thread), without
needing an async `execute`. A BlsRunner keeps nothing per call, so concurrent calls share it safely."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np

from ...errors import TrtDiffusionError
from ...runtime.engines import RunnerTable
from ...targets.runner_base import check_feeds
from ...tensors import TensorSpec
from .. import lora_sets
from ..contract import LORA_SWITCH_S, LORAS_PARAMETER, PRIORITY_BATCH_VALUE, PRIORITY_PARAMETER
from ..description import EngineEntry, PipelineDescription
from . import pb


class RequestCancelled(Exception):
    """The client cancelled (or its deadline passed): stop and free the instance. `requests`: which of the
    requests being served together were cancelled (their partners carry on)."""

    def __init__(self, requests: list | None = None):
        super().__init__()
        self.requests = requests or []


class EngineCallError(TrtDiffusionError):
    """An engine model answered a BLS call with an error."""


# Seconds a batch request sleeps between looks at the other instances while it yields to people
YIELD_POLL_S = 0.015


def is_batch_request(request: Any) -> bool:
    """Whether the request is a job's (the request parameter PRIORITY_PARAMETER = "batch"), not a person's."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError, TypeError):
        return False
    return isinstance(parameters, dict) and parameters.get(PRIORITY_PARAMETER) == PRIORITY_BATCH_VALUE


class RequestContext:
    """The requests an instance is serving now (one, or a batch sharing denoiser calls). Python instances run
    one execute at a time, so one mutable slot per instance is enough; every engine call checks it for
    cancellation, and, when every request it serves is a job's, first waits while a person's request runs on
    another instance of the pipeline (`yield_to_people`; `activity`: activity.Activity, None: never waits)."""

    def __init__(self) -> None:
        self.request: Any = None
        self.requests: list = []  # a batch: checked all together
        self.cancelled: Any = None  # a decoupled request's response sender (is_cancelled) or None
        # LoRA per request: the LoRA names the repository serves, the set of the requests being served now (one
        # set per batch: the batch key holds it) and the seconds the engine models spent switching to it
        self.served_loras: tuple[str, ...] = ()
        self.loras: tuple = ()
        self.lora_switch_s = 0.0
        self._lock = threading.Lock()
        # interactive before batch (issue 46): this instance's people published, the other instances' read; the
        # entry's metrics (batch_yields_total, batch_yield_seconds_total) under `model`; the wait and clock
        # (tests inject theirs)
        self.activity: Any = None
        self.metrics: Any = None
        self.model = ""
        self.wait = time.sleep
        self.clock = time.perf_counter

    def active(self) -> list:
        return self.requests or ([self.request] if self.request is not None else [])

    def publish_people(self, requests: list) -> None:
        """The interactive requests among `requests` are running now on this instance ([]: none)."""
        if self.activity is not None:
            self.activity.publish(sum(1 for r in requests if not is_batch_request(r)))

    def before_engine_call(self) -> None:
        self.raise_if_cancelled()
        self.yield_to_people()

    def yield_to_people(self) -> None:
        """A batch of job requests only: while another instance of the pipeline runs a person's request, wait
        (YIELD_POLL_S at a time, cancellation checked each time); a person's request never waits, nor does a
        single instance (nobody else publishes)."""
        if self.activity is None:
            return
        active = self.active()
        if not active or not all(is_batch_request(r) for r in active) or not self.activity.others_busy():
            return
        started = self.clock()
        try:
            busy = True
            while busy:
                self.wait(YIELD_POLL_S)
                self.raise_if_cancelled()
                busy = self.activity.others_busy() > 0
        finally:
            if self.metrics is not None:
                self.metrics.add("batch_yields_total", model=self.model)
                self.metrics.add("batch_yield_seconds_total", self.clock() - started, model=self.model)

    def add_switch_time(self, seconds: float) -> None:
        with self._lock:  # `cfg: parallel` calls the engines from two threads
            self.lora_switch_s += seconds

    def raise_if_cancelled(self) -> None:
        active = self.requests or ([self.request] if self.request is not None else [])
        cancelled = [r for r in active if r.is_cancelled()]
        if self.cancelled is not None and self.cancelled.is_cancelled():
            cancelled = active or [None]
        if cancelled:
            raise RequestCancelled(cancelled)


class BlsRunner:
    def __init__(self, engine: EngineEntry, context: RequestContext):
        self.name = engine.model
        self.inputs = {t.name: TensorSpec(np.dtype(t.dtype), tuple(d if d >= 0 else None for d in t.shape))
                       for t in engine.inputs}
        self.output_names = [t.name for t in engine.outputs]
        self.takes_loras = bool(engine.loras)  # its model switches LoRA sets and answers LORA_SWITCH_S
        self.context = context

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Checked before every engine call: the denoise loop calls the denoiser once (or twice) a step. A job's
        # request waits here while a person's runs on another instance (it yields; it is not killed).
        self.context.before_engine_call()
        check_feeds(self.name, self.inputs, feeds)
        utils = pb.utils()
        inputs = [utils.Tensor(name, np.ascontiguousarray(value)) for name, value in feeds.items()]
        if self.takes_loras:
            request = utils.InferenceRequest(
                model_name=self.name, requested_output_names=[*self.output_names, LORA_SWITCH_S.name], inputs=inputs,
                parameters={LORAS_PARAMETER: lora_sets.to_json(self.context.loras)})
        else:
            request = utils.InferenceRequest(model_name=self.name, requested_output_names=self.output_names,
                                             inputs=inputs)
        response = request.exec()
        if response.has_error():
            raise EngineCallError(f"engine model {self.name}: {response.error().message()}")
        if self.takes_loras:
            switch = utils.get_output_tensor_by_name(response, LORA_SWITCH_S.name).as_numpy()
            self.context.add_switch_time(float(switch.reshape(-1)[0]))
        # Copies: the response's tensors live in shared memory that is reused once it is released.
        return {name: np.array(utils.get_output_tensor_by_name(response, name).as_numpy(), copy=True)
                for name in self.output_names}


def bls_runner_table(description: PipelineDescription, context: RequestContext) -> RunnerTable:
    table = RunnerTable()
    for engine in description.engines:
        table.add(engine.component, BlsRunner(engine, context), bucket=engine.bucket_object, batch=engine.batch,
                  controlnet=engine.controlnet)
    return table
