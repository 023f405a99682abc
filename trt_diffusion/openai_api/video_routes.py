"""The Videos routes (the `videos` resource of the official client, as SGLang Diffusion serves it): POST /v1/videos
(JSON, or multipart with an `input_reference` image for image-to-video), GET /v1/videos/{id}, GET
/v1/videos/{id}/content (the .mp4), DELETE /v1/videos/{id}, GET /v1/videos. Each clip is a job in the job store,
run by the job runner through the video family's entry (FRAMES in, VIDEO out) — through its stream model where it
has one, whose step messages make the job's `progress` — and encoded as generate writes it (video_files: H.264
.mp4 at 16 fps).

`size` and `seconds` map to what the entry serves (docs/deploy.md): `size` must be one of the entry's WxH
(400 naming them); `seconds` is served as the frame count of that size whose length (frames / 16 fps) is nearest
(ties: the shorter; none given: the shortest). The job says what it was served as (`seconds`, `frames`)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..triton import contract, naming
from ..triton.configs import ROLE
from ..video_files import DEFAULT_FPS
from . import bodies, pngs
from .catalog import is_video_entry
from .errors import ApiError, bad_request
from .job_store import JobStore

MAX_RANDOM_SEED = 2**31
MAX_LIST = 100
PROGRESS_REPORTS = 20  # step messages asked of a video's stream: its progress moves in about 5 % steps
DEFAULT_GUIDANCE = 5.0  # WanPipeline's default


class VideoBody(BaseModel):
    model_config = ConfigDict(extra="forbid", str_max_length=bodies.MAX_PROMPT_CHARS)

    prompt: str = Field(min_length=1, max_length=bodies.MAX_PROMPT_CHARS)
    model: str | None = None
    seconds: float | None = Field(None, gt=0, le=600, allow_inf_nan=False)
    size: str | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=0, le=bodies.MAX_SEED)
    num_inference_steps: int = Field(bodies.DEFAULT_STEPS, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    negative_prompt: str | None = None


@dataclass(frozen=True)
class VideoModel:
    name: str
    clips: tuple[tuple[int, int, int], ...]  # (width, height, frames) the entry serves
    workflows: tuple[str, ...]

    def sizes(self) -> list[str]:
        return list(dict.fromkeys(f"{w}x{h}" for w, h, _ in self.clips))


async def video_models(client) -> dict[str, VideoModel]:
    """Triton's loaded entries of video families, with the clips they serve (request_sizes WxHxF)."""
    served = {}
    for entry in (await client.get_model_repository_index()).models:
        if entry.state and entry.state != "READY":
            continue
        config = (await client.get_model_config(entry.name)).config
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        if parameters.get(ROLE) != "entry" or not is_video_entry(parameters):
            continue
        clips = []
        for label in parameters.get("request_sizes", "").split(";"):
            parts = label.split("x")
            if len(parts) == 3 and all(part.isdigit() for part in parts):
                clips.append(tuple(int(part) for part in parts))
        served[entry.name] = VideoModel(entry.name, tuple(clips), tuple(
            w for w in parameters.get("workflows", "txt2img").split(";") if w))
    return served


def served_clip(model: VideoModel, size: str | None, seconds: float | None) -> tuple[int, int, int]:
    """(width, height, frames) for the request's size and seconds, by the rule in this module's docstring."""
    sizes = model.sizes()
    chosen = size or sizes[0]
    if chosen not in sizes:
        raise bad_request(f"size {chosen} is not served by {model.name}; served sizes: {', '.join(sizes)}", "size")
    width, height = (int(side) for side in chosen.split("x"))
    frames = sorted(f for w, h, f in model.clips if (w, h) == (width, height))
    if seconds is None:
        return width, height, frames[0]
    return width, height, min(frames, key=lambda f: (abs(f / DEFAULT_FPS - seconds), f))


def _size(value: str | None) -> str | None:
    if value is None or value == "auto":
        return None
    width, sep, height = value.partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise bad_request(f"size must be WIDTHxHEIGHT like '832x480' (or 'auto'), got {value!r:.40}", "size")
    return f"{int(width)}x{int(height)}"


def _seconds(frames: int) -> str:
    return f"{frames / DEFAULT_FPS:g}"


async def _read_request(request: Request) -> tuple[dict, bytes | None]:
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type == "application/json":
        data = bodies.load_json(await request.body())
        if not isinstance(data, dict):
            raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
        if "input_reference" in data:
            raise bad_request("input_reference is a file: send it as multipart/form-data", "input_reference")
        return data, None
    if content_type != "multipart/form-data":
        raise ApiError(415, f"/v1/videos takes application/json or multipart/form-data, got "
                            f"{content_type or 'no content type'!r}")
    form = await request.form(max_files=1, max_fields=16)
    fields, reference = {}, None
    for key, value in form.multi_items():
        if isinstance(value, str):
            if key in fields or key == "input_reference":
                raise bad_request(f"field {key!r} is given twice or as text; give it once", key)
            fields[key] = value
        elif key == "input_reference":
            reference = await value.read()
        else:
            raise bad_request(f"unknown file field {key!r}; this endpoint takes the file input_reference", key)
    return fields, reference


def _validated(data: dict, strict: bool) -> VideoBody:
    try:
        return VideoBody.model_validate(data, strict=strict)
    except ValidationError as err:
        message, field = bodies.validation_message(err, VideoBody)
        raise ApiError(400, message, field) from None


def add_routes(app: FastAPI, settings, store: Callable[[], JobStore], runner: Callable[[], object],
               decodes: pngs.DecodeSlots) -> None:

    @app.post("/v1/videos")
    async def create_video(request: Request):
        data, reference = await _read_request(request)
        body = _validated(data, strict=reference is None and "multipart" not in request.headers.get(
            "content-type", ""))
        jobs = store()
        models = await video_models(request.app.state.triton)
        listed = ", ".join(sorted(models)) or "none"
        if body.model is None:
            if len(models) != 1:
                raise bad_request(f"model is required: this server serves {len(models)} video models ({listed})",
                                  "model")
            model = next(iter(models.values()))
        elif body.model not in models:
            raise ApiError(404, f"model {body.model!r} is not a served video model; served: {listed}", "model",
                           "model_not_found")
        else:
            model = models[body.model]
        width, height, frames = served_clip(model, _size(body.size), body.seconds)
        if reference is not None:
            if "img2vid" not in model.workflows:
                raise bad_request(f"{model.name} does not serve image-to-video (input_reference): it serves "
                                  f"{', '.join(model.workflows)}", "input_reference")

            def same_size(w: int, h: int) -> None:
                if (w, h) != (width, height):
                    raise bad_request(f"input_reference is {w}x{h}, the clip {width}x{height}: images are not "
                                      "resized (send the first frame at the clip's size)", "input_reference")

            try:
                await decodes.run(pngs.read_edit_inputs, reference, None, same_size)
            except ApiError as err:
                raise bad_request(err.message.replace("image", "input_reference", 1), "input_reference") from None
        stored = {"prompt": body.prompt, "model": model.name, "width": width, "height": height, "frames": frames,
                  "seed": body.seed if body.seed is not None else secrets.randbelow(MAX_RANDOM_SEED),
                  "steps": body.num_inference_steps, "negative_prompt": body.negative_prompt,
                  "guidance_scale": body.guidance_scale if body.guidance_scale is not None else DEFAULT_GUIDANCE}
        video = jobs.add_video(model.name, body.prompt, stored, _seconds(frames), f"{width}x{height}", reference)
        runner().wake()
        return video

    @app.get("/v1/videos")
    async def list_videos(after: str | None = None, limit: int = 20):
        if not 1 <= limit <= MAX_LIST:
            raise bad_request(f"limit must be in 1..{MAX_LIST}, got {limit}", "limit")
        data, more = store().videos(after, limit)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        return store().video(video_id)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video"):
        if variant != "video":
            raise bad_request(f"variant {variant!r} is not served: only the video (.mp4)", "variant")
        return FileResponse(store().video_content_path(video_id), media_type="video/mp4")  # streamed from disk

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        store().delete_video(video_id)
        runner().cancel(video_id)  # its call in Triton, if it is running: the queue is freed
        return {"id": video_id, "object": "video.deleted", "deleted": True}


def video_runner(state, settings):
    """The runner's `run_video`: one clip through the video entry, as `generate --url` asks for it; returns how to
    write its .mp4. Where the entry has its stream model (`<entry>_stream`, packaged beside it unless
    `package --no-stream`), the clip is asked of the stream, whose step messages drive `progress(percent)`; without
    one, the entry's plain call (the job's progress then goes from 0 to 100 at completion)."""

    async def run(body: dict, reference: bytes | None, progress: Callable[[int], None]):
        from ..triton.client import ImageRequest
        from ..video_files import save_video

        init_image = None
        if reference is not None:
            init_image, _ = await asyncio.to_thread(pngs.read_edit_inputs, reference, None)
        request = ImageRequest(body["prompt"], body["height"], body["width"], steps=body["steps"],
                               guidance_scale=body["guidance_scale"], seed=body["seed"],
                               negative_prompt=body["negative_prompt"], num_images=1, frames=body["frames"],
                               init_image=init_image)
        tensors = request.tensors()
        stream = await stream_model(state.triton, body["model"])
        if stream is None:
            clip = await infer_video(state.triton, body["model"], tensors, settings.timeout_s)
        else:
            steps = body["steps"]
            tensors.pop(contract.NUM_IMAGES.name)  # a stream answers one clip: it has no NUM_IMAGES input
            tensors[contract.PREVIEW_EVERY.name] = np.array([[steps_between_reports(steps)]], np.int32)

            def on_step(result) -> None:
                step = result.as_numpy(contract.STEP.name)
                if step is not None and step.size:
                    progress(int(step.reshape(-1)[0]) * 100 // steps)

            clip = await infer_video(state.triton, stream, tensors, settings.timeout_s, on_step=on_step)
        return lambda path: save_video(clip, path, DEFAULT_FPS, overwrite=True)

    return run


def steps_between_reports(steps: int) -> int:
    """The stream's PREVIEW_EVERY for a clip of `steps`: about PROGRESS_REPORTS step messages (each carries a
    preview of every latent frame, made on the server), at least one per step."""
    return max(1, -(-steps // PROGRESS_REPORTS))


async def stream_model(client, entry: str) -> str | None:
    """The name of `entry`'s stream model (role `stream`: a message per PREVIEW_EVERY steps, then the clip) when
    Triton has it loaded; None otherwise."""
    name = naming.stage_name(entry, "stream")
    index = await client.get_model_repository_index()
    if not any(model.name == name and (not model.state or model.state == "READY") for model in index.models):
        return None
    parameters = (await client.get_model_config(name)).config.parameters
    return name if ROLE in parameters and parameters[ROLE].string_value == "stream" else None


async def infer_video(client, model: str, tensors: dict, timeout_s: float, on_step=None) -> np.ndarray:
    """VIDEO uint8 [F, H, W, 3] of one request to a video entry; ApiError with the entry's words when it refuses.
    `on_step` (`model` is a stream model): each message before the clip goes to on_step(result)."""
    import tritonclient.grpc.aio as grpc_aio
    from tritonclient.utils import InferenceServerException

    from ..triton.client import make_inputs
    from .triton_calls import refusal

    streamed = {} if on_step is None else {"on_partial": on_step}
    try:
        result = await client.infer(model, make_inputs(grpc_aio, tensors),
                                    outputs=[grpc_aio.InferRequestedOutput(contract.VIDEO.name)],
                                    client_timeout=timeout_s, **streamed)
    except InferenceServerException as err:
        raise refusal(err, model) from None
    video = result.as_numpy(contract.VIDEO.name)
    if video is None or video.ndim != 5 or video.dtype != np.uint8 or video.shape[0] != 1 or video.shape[-1] != 3:
        raise ApiError(502, f"Triton's {model} answered no video uint8 [1, F, H, W, 3] "
                            f"({None if video is None else (video.dtype, list(video.shape))})")
    return video[0]
