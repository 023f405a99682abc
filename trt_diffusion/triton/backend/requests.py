"""Triton request tensors -> GenerationRequest, with the user's mistakes as RuntimeInputErrors.

Triton has already checked names, data types and ranks against the config; what is left is the values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import RuntimeInputError
from . import pb

UPSTREAM_PROMPT = "(encoded by the encode stage)"  # the denoise stage never sees the prompt itself
# Checked on the bytes, before decoding or tokenizing (8 MB of text took 13.6 s of tokenizer CPU): 4096
# characters (runtime.pipeline.MAX_PROMPT_CHARS) of up to 4 UTF-8 bytes each.
MAX_PROMPT_BYTES = 4 * 4096
MAX_NAME_BYTES = 256  # SCHEDULER, CONTROLNET


def _only(value: np.ndarray, name: str):
    flat = value.reshape(-1)
    if flat.size != 1:
        raise RuntimeInputError(f"{name} must hold one value, got shape {list(value.shape)}")
    return flat[0]


def _text(value: np.ndarray | None, name: str, max_bytes: int = MAX_NAME_BYTES) -> str | None:
    if value is None:
        return None
    item = _only(value, name)
    size = len(item.encode("utf-8", "surrogatepass")) if isinstance(item, str) else len(bytes(item))
    if size > max_bytes:
        raise RuntimeInputError(f"{name} has {size} bytes (at most {max_bytes})")
    if isinstance(item, str):
        return item
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError:
        raise RuntimeInputError(f"{name} is not valid UTF-8 text") from None


def read_request(request: Any, *, with_prompt: bool = True):
    """The request as a GenerationRequest (imported here: it pulls torch, and model.py must import light)."""
    from ...runtime.pipeline import GenerationRequest

    def get(name: str):
        return pb.input_array(request, name)

    def number(name: str, cast, default=None):
        value = get(name)
        if value is None:
            if default is None:
                raise RuntimeInputError(f"missing input {name}")
            return default
        return cast(_only(value, name))

    controlnet = _text(get("CONTROLNET"), "CONTROLNET") or None
    control_image = get("CONTROL_IMAGE")
    if control_image is not None:
        control_image = np.ascontiguousarray(control_image[0])  # drop the request batch dimension
    prompt = _text(get("PROMPT"), "PROMPT", MAX_PROMPT_BYTES) if with_prompt else UPSTREAM_PROMPT
    return GenerationRequest(
        prompt=prompt if prompt is not None else "",
        negative_prompt=_text(get("NEGATIVE_PROMPT"), "NEGATIVE_PROMPT", MAX_PROMPT_BYTES) if with_prompt else None,
        height=number("HEIGHT", int), width=number("WIDTH", int), steps=number("STEPS", int),
        guidance_scale=number("GUIDANCE_SCALE", float), seed=number("SEED", int),
        scheduler=_text(get("SCHEDULER"), "SCHEDULER") or "default",
        controlnet=controlnet, control_image=control_image,
        controlnet_scale=number("CONTROLNET_SCALE", float, default=1.0),
    )
