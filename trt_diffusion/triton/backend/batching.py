"""The public entry over a batch of requests (Triton's dynamic batcher hands `execute` several at once).

Each request becomes NUM_IMAGES items (seeds SEED, SEED + 1, ...); items that share a batch key (size, steps,
scheduler, CFG, ControlNet, workflow and strength: `EnginePipeline.batch_key`, the only grouping rule) run through
shared denoiser calls (`EnginePipeline.plan_batches` / `generate_together`), split over the engine batches built:
an img2img request never shares a call with a txt2img or inpaint one, nor with an img2img one of another strength. A request that is refused (bad values), fails or is
cancelled gets its own error; its partners are run again without it and still get their images.

Interactive before batch: while a denoising batch runs, the people's requests in it (those without the request
parameter trt_diffusion_priority=batch) are published for the pipeline's other instances (activity.py), where a
batch of jobs' requests waits before its next engine call until they are done (bls.RequestContext.yield_to_people);
an execute runs its batches holding people before those of jobs only.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...errors import RuntimeInputError
from .. import contract
from . import pb
from .bls import EngineCallError, RequestCancelled, RequestContext, is_batch_request
from .metrics import Metrics
from .requests import read_request


@dataclass
class _Answer:
    """What one Triton request has so far: an error, or its images (by item) and timings."""

    count: int = 0
    error: Any = None  # an error response
    images: dict[int, np.ndarray] = field(default_factory=dict)
    timings: list = field(default_factory=list)  # StageTimings of its images
    lora_switch_s: float = 0.0  # engine models switching to its LoRA set, over the batches its images ran in


MAX_SEED = 2**63 - 1  # SEED is INT64: the seed of every image must be one a request (or a PNG) can send again


def num_images(request: Any, limit: int) -> int:
    value = pb.input_array(request, "NUM_IMAGES")
    if value is None:
        return 1
    flat = value.reshape(-1)
    if flat.size != 1:
        raise RuntimeInputError(f"NUM_IMAGES must hold one value, got shape {list(value.shape)}")
    count = int(flat[0])
    if not 1 <= count <= limit:
        raise RuntimeInputError(f"NUM_IMAGES must be between 1 and {limit} (this server's limit), got {count}")
    return count


def sent_ns(request: Any) -> int | None:
    """The client's send time (time.time_ns(), same host) from the request parameters, when it set one."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError, TypeError):
        return None
    value = parameters.get(contract.SENT_NS_PARAMETER)
    return value if isinstance(value, int) else None


def serve_batch(name: str, pipeline: Any, context: RequestContext, requests: list, max_images: int,
                metrics: Metrics | None = None) -> list:
    """One response per request, in order. `metrics`: the entry's (metrics.py), counted as the requests are
    answered."""
    started, started_ns = time.perf_counter(), time.time_ns()
    metrics = metrics or _NO_METRICS
    answers = [_Answer() for _ in requests]
    waited: set[int] = set()  # requests whose queue wait is observed (at their first batch)
    items: list[tuple[int, Any]] = []  # (request index, GenerationRequest of one image)
    for index, request in enumerate(requests):
        # every request parsed here, before any batch: its mistake (or a bug its values hit) is its own answer
        try:
            generation_request = read_request(request, served_loras=context.served_loras)
            count = num_images(request, max_images)
            check_seeds(generation_request.seed, count)
        except Exception as err:  # noqa: BLE001 - a RuntimeInputError is the user's; anything else, a bug: logged
            answers[index].error = _error(name, err)
            metrics.add("refusals_total", model=name)
            continue
        answers[index].count = count
        items += [(index, replace(generation_request, seed=generation_request.seed + k)) for k in range(count)]

    errors, batches = _plan(pipeline, [item for _, item in items])
    for position, err in errors.items():
        owner = items[position][0]
        if answers[owner].error is None:
            answers[owner].error = _error(name, err)
            metrics.add("refusals_total", model=name)
    # people's batches first: a job's batch may be held (bls.RequestContext.yield_to_people), and a person's request
    # Triton gathered into the same execute must not wait behind it
    work = deque(sorted(batches, key=lambda batch: all(is_batch_request(requests[items[p][0]]) for p in batch)))
    while work:
        batch = [p for p in work.popleft() if answers[items[p][0]].error is None]
        owners = list(dict.fromkeys(items[p][0] for p in batch))
        if not batch:
            continue
        context.requests = [requests[o] for o in owners]
        context.loras, context.lora_switch_s = items[batch[0]][1].loras, 0.0  # one set per batch (batch_key)
        wait = time.perf_counter() - started
        for owner in owners:
            if owner not in waited:
                waited.add(owner)
                sent = sent_ns(requests[owner])
                queued = 0.0 if sent is None else max(0.0, (started_ns - sent) / 1e9)
                metrics.observe("queue_wait_seconds", queued + wait, model=name)
        try:
            # the people among them, for the other instances (a job's batch there waits while they run: bls.py)
            context.publish_people(context.requests)
            generations = pipeline.generate_together([items[p][1] for p in batch])
        except RequestCancelled as err:
            cancelled = [o for o in owners if any(requests[o] is r for r in err.requests)] or owners
            for owner in cancelled:
                message = f"{name}: request cancelled after {time.perf_counter() - started:.2f} s"
                pb.utils().Logger.log_info(message)  # the client is gone: the log is where this shows
                answers[owner].error = pb.error_response(message, "CANCELLED")
                metrics.add("cancellations_total", model=name)
            rest = [p for p in batch if answers[items[p][0]].error is None]
            work.extendleft(reversed(_replan(pipeline, items, rest)))  # the partners again, without the cancelled
            continue
        except Exception as err:  # noqa: BLE001 - answers these requests, the model stays up
            if len(owners) > 1:  # run each request on its own: only the one at fault fails
                for owner in reversed(owners):
                    work.extendleft(reversed(_replan(pipeline, items, [p for p in batch if items[p][0] == owner])))
                continue
            answers[owners[0]].error = _error(name, err)
            if isinstance(err, RuntimeInputError):
                metrics.add("refusals_total", model=name)
            continue
        finally:
            context.publish_people([])
            context.requests, context.loras = [], ()
        for owner in owners:
            answers[owner].lora_switch_s += context.lora_switch_s
        for position, generation in zip(batch, generations):
            owner = items[position][0]
            generation.timings.wait_s = wait
            answers[owner].images[position] = generation.images
            item = items[position][1]
            labels = {"model": name, "bucket": _bucket(item), "workflow": item.resolved_workflow.value}
            metrics.add("images_total", len(generation.images), **labels)
            metrics.add("steps_total", len(generation.images) * len(generation.timings.step_s), **labels)
            answers[owner].timings.append(generation.timings)
    return [_response(answer, requests[i], started, started_ns) for i, answer in enumerate(answers)]


class _NoMetrics:
    def add(self, *args, **kwargs) -> None:
        pass

    def observe(self, *args, **kwargs) -> None:
        pass


_NO_METRICS = _NoMetrics()


def _bucket(item: Any) -> str:
    """The metrics' bucket label: the request's size, WxH (a video's WxHxF)."""
    return f"{item.width}x{item.height}" + (f"x{item.frames}" if item.frames else "")


def check_seeds(seed: int, count: int) -> None:
    """The images of a request get seeds SEED, SEED + 1, ...: each must fit INT64 as SEED does, or the seed an
    image reports (its PNG, the API's `seed`) could not be sent again. Refused rather than wrapped: a wrapped seed
    would replay as a request of its own, but its neighbours would not follow it."""
    last = seed + count - 1
    if last > MAX_SEED:
        raise RuntimeInputError(f"SEED {seed} with NUM_IMAGES {count} gives seeds up to {last}, beyond "
                                f"{MAX_SEED} (SEED is INT64): use a SEED of at most {MAX_SEED - count + 1}")


def _plan(pipeline: Any, requests: list) -> tuple[dict[int, BaseException], list[list[int]]]:
    """plan_batches, with a bug one request's values hit in validation kept to that request: the batch is planned
    again without it (validation refuses user mistakes itself, as RuntimeInputErrors by index)."""
    try:
        return pipeline.plan_batches(requests)
    except Exception:  # noqa: BLE001 - found below, request by request
        pass
    errors: dict[int, BaseException] = {}
    for index, request in enumerate(requests):
        try:
            errors.update({index: err for err in pipeline.plan_batches([request])[0].values()})
        except Exception as err:  # noqa: BLE001 - that request's own answer
            errors[index] = err
    good = [i for i in range(len(requests)) if i not in errors]
    _, batches = pipeline.plan_batches([requests[i] for i in good]) if good else ({}, [])
    return errors, [[good[i] for i in batch] for batch in batches]


def _replan(pipeline: Any, items: list, positions: list[int]) -> list[list[int]]:
    _, batches = _plan(pipeline, [items[p][1] for p in positions])
    return [[positions[i] for i in batch] for batch in batches]


def _error(name: str, err: BaseException):
    if isinstance(err, RuntimeInputError):
        return pb.error_response(f"{name}: {err}")
    if isinstance(err, EngineCallError):
        return pb.error_response(f"{name}: {err}", "INTERNAL")
    return pb.internal_error(name, err)


def timing_json(timings: list, started: float, sent: int | None, started_ns: int, lora_switch_s: float = 0.0) -> str:
    """The request's timings: Triton queue (when the client sent its send time), the wait behind other batches
    of the same execute, text encoding, image encoding (img2vid: the first frame's CLIP embeds and the
    conditioning clip's VAE encode), each step of each denoising batch its images ran in, VAE decode, and the
    engine models' switching to its LoRA set (0 for the base model and for a set they kept applied)."""
    return json.dumps({
        "queue_s": None if sent is None else max(0.0, (started_ns - sent) / 1e9),
        "wait_s": min(t.wait_s for t in timings),
        "text_encode_s": sum(t.text_encode_s for t in timings),
        "image_encode_s": sum(t.image_encode_s for t in timings),
        "steps_s": _unique_batches(timings),
        "vae_decode_s": sum(t.vae_decode_s for t in timings),
        "lora_switch_s": lora_switch_s,
        "batch": [t.batch for t in timings],  # requests' images sharing the denoiser calls, per image
        "total_s": time.perf_counter() - started,
    })


def _unique_batches(timings: list) -> list[list[float]]:
    seen, batches = set(), []
    for t in timings:
        key = id(t.step_s) if t.batch == 1 else tuple(t.step_s)
        if key not in seen:
            seen.add(key)
            batches.append(list(t.step_s))
    return batches


def _response(answer: _Answer, request: Any, started: float, started_ns: int):
    if answer.error is not None:
        return answer.error
    utils = pb.utils()
    images = np.concatenate([answer.images[p] for p in sorted(answer.images)])  # [N, H, W, 3], seed order
    timing = timing_json(answer.timings, started, sent_ns(request), started_ns, answer.lora_switch_s)
    # One image: [1, H, W, 3] as before (the request's batch dimension); N images: [N, H, W, 3]; videos
    # [N, F, H, W, 3] as VIDEO
    name = result_name(images)
    return response_with_timing([utils.Tensor(name, np.ascontiguousarray(images))], timing, int(images.shape[0]))


def result_name(images: np.ndarray) -> str:
    """The output a generation goes out as: VIDEO for clips [N, F, H, W, 3], IMAGE for images."""
    return (contract.VIDEO if images.ndim == 5 else contract.IMAGE).name


def response_with_timing(tensors: list, timing: str, images: int):
    """The response with TIMING (JSON) as an output, and as response parameters where the python backend can
    set them (newer Triton); 2.51 cannot."""
    utils = pb.utils()
    tensors = [*tensors, utils.Tensor("TIMING", np.array([[timing.encode()]], dtype=object))]
    try:
        return utils.InferenceResponse(tensors, parameters={contract.TIMING_PARAMETER: timing, "images": images})
    except TypeError:
        return utils.InferenceResponse(tensors)
