"""The request bodies the API accepts: OpenAI's fields, plus extensions named as diffusers names them
(`seed`, `num_inference_steps`, `guidance_scale`, `negative_prompt`; `strength` for edits). A field neither
OpenAI's nor ours is refused (400), never ignored: a misspelt `num_inference_step` would otherwise run 20 steps
silently."""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ApiError, bad_request

MAX_PROMPT_CHARS = 4096  # the entry's PROMPT limit (docs/triton.md)
MAX_N = 10  # OpenAI's own bound; a served entry may allow fewer (its max_images)
MAX_SEED = 2**63 - 1  # SEED is INT64
DEFAULT_STEPS = 20
MAX_JSON_DEPTH = 16  # our deepest field (loras: a list of objects) is 2 levels below the body


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", str_max_length=MAX_PROMPT_CHARS)

    model: str | None = None  # None: the only model served (several: the request must name one)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = None  # "WIDTHxHEIGHT", one of the served buckets; None or "auto": the model's first
    response_format: str | None = None  # b64_json only
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    # extensions, diffusers' names
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # None: a random seed, returned in the response
    num_inference_steps: int = Field(DEFAULT_STEPS, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)  # None: 7.5 (the CLI's)
    negative_prompt: str | None = None
    loras: list[dict[str, Any]] | None = None  # [{"name", "scale"}]: only where the entry takes LORAS

    @field_validator("response_format")
    @classmethod
    def _b64_only(cls, value: str | None) -> str | None:
        if value not in (None, "b64_json"):
            raise ValueError(f"response_format {value!r} is not served: images come back inline, use "
                             "response_format b64_json")
        return value

    @field_validator("size")
    @classmethod
    def _size_form(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return None
        width, sep, height = value.partition("x")
        if not (sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
            raise ValueError(f"size must be WIDTHxHEIGHT like '512x512' (or 'auto'), got {value!r}")
        return f"{int(width)}x{int(height)}"


class GenerationBody(_Body):
    """POST /v1/images/generations (JSON)."""


class EditBody(_Body):
    """POST /v1/images/edits (a multipart form, or OpenAI's JSON form: the image and mask are read apart from these
    fields)."""

    strength: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)  # None: img2img 0.8, inpaint 1.0


class EditJsonBody(EditBody):
    """POST /v1/images/edits as JSON (OpenAI's JSON form; a batch line's body): the image and mask inline."""

    images: Any = None  # [{"image_url": "data:image/png;base64,..."}]: checked by edit_from_json
    mask: Any = None  # {"image_url": ...}


def _field_names(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def validation_message(err: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """(one sentence naming each bad field and its value, the first bad field) from pydantic's errors."""
    problems, first = [], None
    for item in err.errors():
        field = ".".join(str(part) for part in item["loc"]) or "body"
        first = first or field
        if item["type"] == "extra_forbidden":
            problems.append(f"unknown field {field!r}; this endpoint takes {_field_names(model)}")
        elif item["type"] == "missing":
            problems.append(f"{field} is required")
        else:
            message = item["msg"].removeprefix("Value error, ")
            shown = repr(item.get("input"))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            problems.append(f"{field}: {message} (got {shown})" if "got" not in message else f"{field}: {message}")
    return "; ".join(problems), first


def load_json(raw: bytes | str, what: str = "the body", field: str | None = None) -> Any:
    """JSON text as Python values; 400 for text that is not JSON or that nests deeper than MAX_JSON_DEPTH (the
    decoder recurses per level: 100,000 `[` would be a RecursionError, and a deep value one later in pydantic or
    json.dumps)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request(f"{what} nests too deeply (at most {MAX_JSON_DEPTH} levels)", field) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"{what} is not JSON: {exc}", field) from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise bad_request(f"{what} nests too deeply (at most {MAX_JSON_DEPTH} levels)", field)
    return data


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_JSON_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def parse_generation(raw: bytes) -> GenerationBody:
    """The JSON body of a generation request; ApiError 400 naming what is wrong."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
    return _validate(GenerationBody, data, strict=True)


def parse_edit(fields: dict[str, str]) -> EditBody:
    """The form fields of an edit request (strings: numbers are parsed as numbers)."""
    data: dict[str, Any] = dict(fields)
    if "loras" in data:  # a JSON list in a form field
        try:
            data["loras"] = load_json(data["loras"], "loras", "loras")
        except ApiError as err:
            if "nests too deeply" in err.message:
                raise
            shown = data["loras"] if len(data["loras"]) <= 80 else data["loras"][:77] + "..."
            raise bad_request(f"loras must be a JSON list like [{{\"name\": \"style\", \"scale\": 0.8}}], got "
                              f"{shown!r}", "loras") from None
    return _validate(EditBody, data, strict=False)


def parse_edit_json(raw: bytes) -> tuple[EditBody, bytes, bytes | None]:
    """The JSON body of an edit request (the online route's application/json form, a batch line's body)."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
    return edit_from_json(data)


def edit_from_json(data: dict) -> tuple[EditBody, bytes, bytes | None]:
    """(fields, image bytes, mask bytes or None) of OpenAI's JSON form of an edit: `images: [{"image_url":
    "data:image/png;base64,..."}]` (one image: the entries take one) and an optional `mask: {"image_url": ...}`.
    Images travel inline as base64 data URLs: the server fetches no URL, and its Files store holds batch inputs
    only, so a `file_id` is refused naming what is accepted. The bytes are then read as the multipart files are
    (pngs.read_edit_inputs)."""
    if "image" in data:
        raise bad_request(f"image is the multipart form's file field; a JSON body sends {EDIT_IMAGES_FORM}",
                          "image")
    body = _validate(EditJsonBody, data, strict=True)
    images = body.images
    if images is None:
        raise bad_request(f"images is required: {EDIT_IMAGES_FORM}", "images")
    if not isinstance(images, list) or not images:
        raise bad_request(f"images must be a list of one image, {EDIT_IMAGES_FORM}; got {_shown(images)}",
                          "images")
    if len(images) > 1:
        raise bad_request(f"one image per request: {len(images)} were sent", "images")
    image = _data_url_bytes(images[0], "images[0]")
    mask = None if body.mask is None else _data_url_bytes(body.mask, "mask")
    return body, image, mask


EDIT_IMAGES_FORM = 'images: [{"image_url": "data:image/png;base64,..."}]'
_DATA_URL = re.compile(r"data:(?:image/[A-Za-z0-9.+-]+)?(?:;[^,;]*=[^,;]*)*;base64,", re.ASCII)


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _data_url_bytes(reference: Any, field: str) -> bytes:
    """The bytes of `{"image_url": "data:image/...;base64,..."}`; 400 naming `field` for anything else."""
    if not isinstance(reference, dict) or len(reference) != 1 or not {"image_url", "file_id"} & set(reference):
        raise bad_request(f'{field} must be {{"image_url": "data:image/png;base64,..."}}, got {_shown(reference)}',
                          field)
    if "file_id" in reference:
        raise bad_request(f"{field}.file_id is not served: the Files store here holds batch inputs only; send the "
                          "image inline as image_url, a data URL like data:image/png;base64,...", field)
    url = reference["image_url"]
    if not isinstance(url, str):
        raise bad_request(f"{field}.image_url must be a string (a data URL), got {_shown(url)}", field)
    match = _DATA_URL.match(url)
    if match is None:
        fetch = re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", url) is not None
        what = "a URL to fetch (the server fetches no URLs)" if fetch else "not a base64 data URL"
        raise bad_request(f"{field}.image_url is {what}: send the image inline as a data URL like "
                          f"data:image/png;base64,... (got {_shown(url[:40])})", field)
    try:
        return base64.b64decode(url[match.end():], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{field}.image_url is not valid base64 ({exc})", field) from None


def _validate(model: type[_Body], data: dict, strict: bool) -> Any:
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as err:
        message, field = validation_message(err, model)
        raise ApiError(400, message, field) from None
