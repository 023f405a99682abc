"""Lazy access to `triton_python_backend_utils` and the error responses every model sends."""

from __future__ import annotations

import traceback
from typing import Any


def utils() -> Any:
    import triton_python_backend_utils

    return triton_python_backend_utils


def error_response(message: str, code: str = "INVALID_ARG") -> Any:
    """An error response: the request fails with `message`, the model and the server stay up."""
    pb = utils()
    return pb.InferenceResponse(error=pb.TritonError(message, getattr(pb.TritonError, code)))


def internal_error(what: str, err: BaseException) -> Any:
    """A bug's answer: its kind only (a message can carry the server's paths, a traceback its code), and the whole
    traceback in the server's log."""
    utils().Logger.log_error(f"{what}: {''.join(traceback.format_exception(err))}")
    return error_response(f"{what}: internal error ({type(err).__name__}); the server log has the details",
                          "INTERNAL")


def input_array(request: Any, name: str):
    """The input as a numpy array, or None when an optional input is absent."""
    tensor = utils().get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
