"""BLS runners: the Runner protocol over Triton models, so `DiffusionPipeline` runs unchanged inside Triton
and calls each engine's model every step; the same pipeline code in process and in the server gives the
same images."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import TrtDiffusionError
from ...runtime.engines import RunnerTable
from ...runtime.runners import TensorSpec, check_feeds
from ..description import EngineEntry, PipelineDescription
from . import pb


class RequestCancelled(Exception):
    """The client cancelled (or its deadline passed): stop and free the instance."""


class EngineCallError(TrtDiffusionError):
    """An engine model answered a BLS call with an error."""


class RequestContext:
    """The request an instance is serving now. Python instances serve one request at a time, so one
    mutable slot per instance is enough; every engine call checks it for cancellation."""

    def __init__(self) -> None:
        self.request: Any = None

    def raise_if_cancelled(self) -> None:
        if self.request is not None and self.request.is_cancelled():
            raise RequestCancelled()


class BlsRunner:
    def __init__(self, engine: EngineEntry, context: RequestContext):
        self.name = engine.model
        self.inputs = {t.name: TensorSpec(np.dtype(t.dtype), tuple(d if d >= 0 else None for d in t.shape))
                       for t in engine.inputs}
        self.output_names = [t.name for t in engine.outputs]
        self.context = context

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Checked before every engine call: the denoise loop calls the denoiser once (or twice) a step.
        self.context.raise_if_cancelled()
        check_feeds(self.name, self.inputs, feeds)
        utils = pb.utils()
        request = utils.InferenceRequest(
            model_name=self.name, requested_output_names=self.output_names,
            inputs=[utils.Tensor(name, np.ascontiguousarray(value)) for name, value in feeds.items()])
        response = request.exec()
        if response.has_error():
            raise EngineCallError(f"engine model {self.name}: {response.error().message()}")
        # Copies: the response's tensors live in shared memory that is reused once it is released.
        return {name: np.array(utils.get_output_tensor_by_name(response, name).as_numpy(), copy=True)
                for name in self.output_names}


def bls_runner_table(description: PipelineDescription, context: RequestContext) -> RunnerTable:
    table = RunnerTable()
    for engine in description.engines:
        table.add(engine.component, BlsRunner(engine, context), bucket=engine.bucket_object, batch=engine.batch,
                  controlnet=engine.controlnet)
    return table
