"""Warm a pipeline model's Python side before the server says ready.

Triton's `model_warmup` warms the engine models; the pipeline models' first request would still pay for
lazy imports (diffusers' schedulers), first tokenizer calls and first torch ops. Here the real pipeline code
runs once per bucket and scheduler over stand-in runners that return zeros of each engine's output shape
(BLS calls are not possible during `initialize`).
"""

from __future__ import annotations

import time

import numpy as np

from ...engines_file.engine_spec import Size
from ...runtime.engines import RunnerTable
from ...tensors import TensorSpec
from ..description import EngineEntry, PipelineDescription
from . import pb


class ZeroRunner:
    def __init__(self, engine: EngineEntry):
        self.name = f"{engine.model} (warm-up stand-in)"
        self.inputs = {t.name: TensorSpec(np.dtype(t.dtype), tuple(t.shape)) for t in engine.inputs}
        self.outputs = {t.name: (np.dtype(t.dtype), tuple(t.shape)) for t in engine.outputs}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.zeros(shape, dtype) for name, (dtype, shape) in self.outputs.items()}


def _is_static(engine: EngineEntry) -> bool:
    return all(d >= 0 for t in (*engine.inputs, *engine.outputs) for d in t.shape)


def warm_up_in_process(pipeline, description: PipelineDescription) -> float:
    """Seconds spent. Best effort: a failure is logged and never stops the model from loading."""
    from ...runtime.pipeline import GenerationRequest
    from ...runtime.schedulers import scheduler_names

    start = time.perf_counter()
    stand_ins = RunnerTable()
    for engine in description.engines:
        if _is_static(engine):  # dynamic engines' output shapes are unknown here: warmed on first use
            stand_ins.add(engine.component, ZeroRunner(engine), bucket=engine.bucket_object, batch=engine.batch,
                          controlnet=engine.controlnet)
    sizes = [e.bucket_object.opt for e in description.engines
             if e.component == pipeline.denoiser and e.bucket and _is_static(e) and e.controlnet is None]
    try:
        requests = [GenerationRequest(prompt="warm-up", height=s.height, width=s.width, steps=2, frames=s.frames)
                    for s in dict.fromkeys(sizes)]
        if requests:
            first = requests[0]
            requests += [GenerationRequest(prompt="warm-up", height=first.height, width=first.width, steps=2,
                                           frames=first.frames, scheduler=name)
                         for name in scheduler_names(description.family)[1:]]
            requests += _image_requests(pipeline, stand_ins, first)
        with pipeline.runners_swapped(stand_ins):  # the family loops (FLUX, Wan) too: no BLS call here
            for request in requests:
                pipeline.generate(request)
    except Exception as err:  # noqa: BLE001
        pb.utils().Logger.log_warn(f"python warm-up of {description.pipeline} stopped early: {err}")
    return time.perf_counter() - start


def _image_requests(pipeline, stand_ins: RunnerTable, first) -> list:
    """One request per image workflow the pipeline serves (img2img, inpaint: the init image's encoding, the
    trimmed schedule, the mask), where a static VAE encoder stand-in covers the first size."""
    from ...runtime.pipeline import GenerationRequest
    from ...workflows import Workflow

    size = Size(first.width, first.height)
    if not any(e.component == "vae_encoder" and e.bucket is not None and e.bucket.covers(size)
               for e in stand_ins.entries):
        return []
    image = np.zeros((first.height, first.width, 3), np.uint8)
    mask = np.full((first.height, first.width), 255, np.uint8)
    return [GenerationRequest(prompt="warm-up", height=first.height, width=first.width, steps=2, workflow=w.value,
                              init_image=image, mask=mask if w.needs_mask else None)
            for w in (Workflow.img2img, Workflow.inpaint) if w in pipeline.workflows]
