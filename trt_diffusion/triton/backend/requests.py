"""Triton request tensors -> GenerationRequest, with the user's mistakes as RuntimeInputErrors.

Triton has already checked names, data types and ranks against the config; what is left is the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import RuntimeInputError
from ..lora_sets import MAX_LORAS_BYTES, parse_loras
from . import pb

UPSTREAM_PROMPT = "(encoded by the encode stage)"  # the denoise stage never sees the prompt itself
# Checked on the bytes, before decoding or tokenizing (8 MB of text took 13.6 s of tokenizer CPU): 4096
# characters (runtime.pipeline.MAX_PROMPT_CHARS) of up to 4 UTF-8 bytes each.
MAX_PROMPT_BYTES = 4 * 4096
MAX_NAME_BYTES = 256  # SCHEDULER, CONTROLNET, WORKFLOW


def _only(value: np.ndarray, name: str):
    flat = value.reshape(-1)
    if flat.size != 1:
        raise RuntimeInputError(f"{name} must hold one value, got shape {list(value.shape)}")
    return flat[0]


def _text(value: np.ndarray | None, name: str, max_bytes: int = MAX_NAME_BYTES) -> str | None:
    if value is None:
        return None
    item = _only(value, name)
    if not isinstance(item, (str, bytes)):  # BYTES on the wire; bytes(n) of another object would allocate n bytes
        raise RuntimeInputError(f"{name} must be text, got {type(item).__name__}")
    size = len(item.encode("utf-8", "surrogatepass")) if isinstance(item, str) else len(bytes(item))
    if size > max_bytes:
        raise RuntimeInputError(f"{name} has {size} bytes (at most {max_bytes})")
    if isinstance(item, str):
        return item
    try:
        return bytes(item).decode("utf-8")
    except UnicodeDecodeError:
        raise RuntimeInputError(f"{name} is not valid UTF-8 text") from None


def _decimal(value) -> float:
    """An FP32 wire value as the decimal the client meant: the shortest one that rounds to the same float32
    (0.7 arrives as 0.699999988; in process it is 0.7, and int(10 * strength) must keep the same steps)."""
    return float(str(np.float32(value)))


def _image(value: np.ndarray | None, name: str) -> np.ndarray | None:
    """One image of the request (its batch dimension of 1 dropped): CONTROL_IMAGE, INIT_IMAGE, MASK."""
    if value is None:
        return None
    if value.shape[0] != 1:
        raise RuntimeInputError(f"{name} must hold one image, got shape {list(value.shape)}")
    return np.ascontiguousarray(value[0])


def read_request(request: Any, *, with_prompt: bool = True, served_loras: Sequence[str] = ()):
    """The request as a GenerationRequest (imported here: it pulls torch, and model.py must import light).
    `served_loras`: the LoRA names the repository holds; LORAS naming another is refused by name."""
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
    strength, guidance_2, length = get("STRENGTH"), get("GUIDANCE_SCALE_2"), get("MAX_SEQUENCE_LENGTH")
    prompt = _text(get("PROMPT"), "PROMPT", MAX_PROMPT_BYTES) if with_prompt else UPSTREAM_PROMPT
    return GenerationRequest(
        prompt=prompt if prompt is not None else "",
        negative_prompt=_text(get("NEGATIVE_PROMPT"), "NEGATIVE_PROMPT", MAX_PROMPT_BYTES) if with_prompt else None,
        height=number("HEIGHT", int), width=number("WIDTH", int), steps=number("STEPS", int),
        guidance_scale=number("GUIDANCE_SCALE", float), seed=number("SEED", int),
        scheduler=_text(get("SCHEDULER"), "SCHEDULER") or "default",
        controlnet=controlnet, control_image=_image(get("CONTROL_IMAGE"), "CONTROL_IMAGE"),
        controlnet_scale=number("CONTROLNET_SCALE", float, default=1.0),
        # the workflow and its inputs: checked against what this model serves by EnginePipeline.validate
        workflow=_text(get("WORKFLOW"), "WORKFLOW") or None,
        init_image=_image(get("INIT_IMAGE"), "INIT_IMAGE"), mask=_image(get("MASK"), "MASK"),
        strength=None if strength is None else _decimal(_only(strength, "STRENGTH")),
        # video: FRAMES absent is an image request (a video model says what it needs)
        frames=number("FRAMES", int, default=0), guidance_scale_2=None if guidance_2 is None else _decimal(
            _only(guidance_2, "GUIDANCE_SCALE_2")),
        # Qwen-Image's; absent: the family's default. Its range (and other families' refusal) is the pipeline's
        max_sequence_length=None if length is None else int(_only(length, "MAX_SEQUENCE_LENGTH")),
        loras=parse_loras(_text(get("LORAS"), "LORAS", MAX_LORAS_BYTES), served_loras),
        # "on" | "off"; absent: engines.yaml's default (EnginePipeline.validate refuses anything else)
        step_cache=_text(get("STEP_CACHE"), "STEP_CACHE") or None,
        inputs=family_inputs(get),
    )


def family_inputs(get) -> dict[str, float]:
    """The family inputs a request holds (families/<name>.py `request_inputs`; only the entries of the families that
    declare one take it: Triton refuses it elsewhere), by diffusers' argument; a value out of the declared range
    is refused naming the input. The family's check of its own (EnginePipeline.validate) runs again in process."""
    from ...families import request_inputs_of_all

    values = {}
    for argument, declared in request_inputs_of_all().items():
        value = get(declared.name)
        if value is None:
            continue
        item = _only(value, declared.name)
        number = _decimal(item) if declared.data_type is float else int(item)
        if (why := declared.problem(number)) is not None:
            raise RuntimeInputError(why)
        values[argument] = number
    return values
