"""Warm a pipeline model's Python side before the server says ready.

Triton's `model_warmup` warms the engine models; the pipeline models' first request would still pay for
lazy imports (diffusers' schedulers), first tokenizer calls and first torch ops. Here the real pipeline code
runs once per bucket and scheduler over stand-in runners that return zeros of each engine's output shape
(BLS calls are not possible during `initialize`), in the model's natural workflow: an image-to-video model
serves img2vid alone, so its warm-up requests carry a seeded first frame.

Qwen-Image's text encoder and transformer are dynamic on every axis but their widths (the text length varies per
prompt, the batch and patch grid follow the request): their stand-ins answer zeros shaped after the call's first
input (`FollowingRunner`), so its bucket is warmed as a static one is; with an empty negative prompt, so true CFG's
second call runs too (sample_inputs.cfg_fields).
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
    def __init__(self, engine: EngineEntry, outputs: dict[str, tuple[int, ...]] | None = None):
        self.name = f"{engine.model} (warm-up stand-in)"
        self.inputs = {t.name: TensorSpec(np.dtype(t.dtype), tuple(t.shape)) for t in engine.inputs}
        self.outputs = {t.name: (np.dtype(t.dtype), tuple((outputs or {}).get(t.name, t.shape)))
                        for t in engine.outputs}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.zeros(shape, dtype) for name, (dtype, shape) in self.outputs.items()}


class FollowingRunner(ZeroRunner):
    """Zeros whose dynamic dimensions are the first input's leading ones: Qwen-Image's text encoder (hidden_states
    [B, L, D] from input_ids [B, L]) and transformer (noise_pred [B, h/2, w/2, 64] from hidden_states, the same
    shape)."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        first = np.shape(feeds[next(iter(self.inputs))])
        return {name: np.zeros(tuple(first[i] if d < 0 else d for i, d in enumerate(shape)), dtype)
                for name, (dtype, shape) in self.outputs.items()}


# the engines FollowingRunner stands in for: (family, component)
_FOLLOWING = {("qwen_image", "text_encoder"), ("qwen_image", "transformer"),
              # FLUX.2: prompt_embeds [B, 512, J] from input_ids [B, 512]; noise_pred [B, T, 128] from hidden_states
              ("flux2", "text_encoder"), ("flux2", "transformer"),
              ("flux2_klein", "text_encoder"), ("flux2_klein", "transformer")}


def _follows(engine: EngineEntry, family: str) -> bool:
    """Whether the engine's outputs are shaped after its first input where dynamic (see `FollowingRunner`)."""
    if (family, engine.component) not in _FOLLOWING or not engine.inputs:
        return False
    rank = len(engine.inputs[0].shape)  # every dynamic output dimension must have one there to follow
    return all(i < rank for t in engine.outputs for i, d in enumerate(t.shape) if d < 0)


def _is_static(engine: EngineEntry) -> bool:
    return all(d >= 0 for t in (*engine.inputs, *engine.outputs) for d in t.shape)


def _stand_in(engine: EngineEntry, vae_scale_factor: int, family: str = "") -> ZeroRunner | None:
    """A stand-in where the engine's output shapes are known: a static engine's, a VAE encoder's at a static
    bucket, whose latent sides are its image's over the VAE factor (its export names them apart from the image's
    sides, so the manifest keeps them dynamic: img2vid runs one on every request), and Qwen-Image's text encoder
    and transformer, shaped after their first input. None: warmed on first use."""
    if _is_static(engine):
        return ZeroRunner(engine)
    if _follows(engine, family):
        return FollowingRunner(engine)
    bucket = engine.bucket_object
    if engine.component != "vae_encoder" or bucket is None or bucket.min != bucket.max \
            or any(d < 0 for t in engine.inputs for d in t.shape):
        return None
    latent = (bucket.opt.height // vae_scale_factor, bucket.opt.width // vae_scale_factor)
    outputs = {}
    for tensor in engine.outputs:
        *leading, height, width = tensor.shape
        if any(d < 0 for d in leading):
            return None
        outputs[tensor.name] = (*leading, latent[0] if height < 0 else height, latent[1] if width < 0 else width)
    return ZeroRunner(engine, outputs)


def warm_up_in_process(pipeline, description: PipelineDescription) -> float:
    """Seconds spent. Best effort: a failure is logged and never stops the model from loading."""
    from ...runtime.pipeline import GenerationRequest
    from ...runtime.schedulers import scheduler_names
    from ...sample_inputs import cfg_fields, natural_workflow, request_fields

    start = time.perf_counter()
    stand_ins = RunnerTable()
    for engine in description.engines:
        # none for a dynamic engine: warmed on first use
        stand_in = _stand_in(engine, pipeline.vae_scale_factor, description.family)
        if stand_in is not None:
            stand_ins.add(engine.component, stand_in, bucket=engine.bucket_object, batch=engine.batch,
                          controlnet=engine.controlnet)
    # the buckets whose denoiser has a stand-in: a static engine's (or Qwen-Image's, shaped after its input)
    sizes = [e.bucket_object.opt for e in description.engines
             if e.component == pipeline.denoiser and e.bucket and e.controlnet is None
             and (_is_static(e) or _follows(e, description.family))]
    # the model's natural workflow: an image-to-video model serves img2vid alone (its requests carry a first frame)
    workflow = natural_workflow(pipeline.workflows)
    try:
        cfg = cfg_fields(description.family)  # Qwen-Image: an empty negative prompt, so its true CFG runs
        requests = [GenerationRequest(prompt="warm-up", height=s.height, width=s.width, steps=2, frames=s.frames,
                                      **cfg, **request_fields(workflow, s.height, s.width))
                    for s in dict.fromkeys(sizes)]
        if requests:
            first = requests[0]
            requests += [GenerationRequest(prompt="warm-up", height=first.height, width=first.width, steps=2,
                                           frames=first.frames, scheduler=name, **cfg,
                                           **request_fields(workflow, first.height, first.width))
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
