"""One image request to a Triton entry over gRPC (asyncio), its refusals as API errors, and cancellation: when the
HTTP client goes away, the gRPC call is cancelled and the entry stops at its next engine call."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ..triton import contract
from ..triton.client import make_inputs
from .errors import ApiError

DISCONNECT_POLL_S = 0.2
# Triton's words for an entry's full queue and a request that waited past its queue timeout (gRPC status UNAVAILABLE,
# like a server that is not there: the words tell them apart)
BUSY_MARKERS = ("exceeds maximum queue size", "request timeout expired")


async def infer_images(client, model: str, tensors: dict[str, np.ndarray], timeout_s: float) -> np.ndarray:
    """IMAGE uint8 [N, H, W, 3] of one request to `model`; ApiError with the entry's words when it refuses."""
    import tritonclient.grpc.aio as grpc_aio
    from tritonclient.utils import InferenceServerException

    try:
        result = await client.infer(model, make_inputs(grpc_aio, tensors),
                                    outputs=[grpc_aio.InferRequestedOutput(contract.IMAGE.name)],
                                    client_timeout=timeout_s,
                                    parameters={contract.SENT_NS_PARAMETER: time.time_ns()})
    except InferenceServerException as err:
        raise refusal(err, model) from None
    images = result.as_numpy(contract.IMAGE.name)
    if images is None or images.ndim != 4 or images.dtype != np.uint8 or images.shape[-1] != 3:
        raise ApiError(502, f"Triton's {model} answered no image uint8 [N, H, W, 3] "
                            f"({None if images is None else (images.dtype, list(images.shape))})")
    return images


def refusal(err, model: str) -> ApiError:
    """Triton's error as the status OpenAI's clients expect: the queue full -> 429, a bad value -> 400, ..."""
    message = (err.message() or "").removeprefix(f"{model}: ")
    status = str(err.status() or "")
    lowered = message.lower()
    if any(marker in lowered for marker in BUSY_MARKERS):
        return ApiError(429, f"{model} is busy ({message}); retry later", code="queue_full")
    if "INVALID_ARGUMENT" in status:
        return ApiError(400, message)
    if "DEADLINE_EXCEEDED" in status:
        return ApiError(504, f"{model} did not answer in time ({message})")
    if "CANCELLED" in status:
        return ApiError(499, f"the request was cancelled ({message})")
    if "NOT_FOUND" in status:
        return ApiError(404, message, "model", "model_not_found")
    if "UNAVAILABLE" in status:
        return ApiError(503, f"Triton is unavailable: {message}")
    return ApiError(500, f"Triton's {model} failed: {message or status}")


async def until_done_or_gone(request, work) -> object:
    """Await `work` (a coroutine) unless the HTTP client disconnects first: then cancel it (the gRPC call with
    it, which Triton passes to the entry) and raise ApiError 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "the client disconnected; the request was cancelled")
    finally:
        if not task.done():
            task.cancel()
