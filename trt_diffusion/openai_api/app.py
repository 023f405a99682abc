"""The routes: POST /v1/images/generations, POST /v1/images/edits (a multipart form, or OpenAI's JSON form with the
image as a data URL), GET /v1/models[/{id}], GET /health; the Files and Batch routes (batch_routes.py) whose lines
run through the same entries as the online routes (generation_response, edit_response);
the Videos routes (video_routes.py), video jobs run by the same job runner.

Every error leaves as OpenAI's error shape (errors.py); a bad request never costs Triton a call: the body, the
model, the size, n and the LoRAs are checked here against what the entry declares and the limits it documents,
the rest by the entry itself. An uploaded image is checked by its header before it is decoded, and decoded in a
worker thread, a few at a time (pngs.DecodeSlots): the event loop keeps answering meanwhile."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from functools import partial
from types import SimpleNamespace

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..image_files import ImageParameters
from ..triton.client import ImageRequest
from . import batch_routes, bodies, pngs, video_routes
from .catalog import Catalog, ServedModel, check_n, check_size
from .errors import ApiError, bad_request
from .guards import BrowserGuard
from .job_runner import JobRunner
from .job_slots import BatchPriorityClient, JobSlots
from .limits import BodyLimit
from .overload import DEGRADED_HEADER, OverloadGate
from .replicas import ReplicaClient
from .settings import ApiSettings
from .triton_calls import infer_images, until_done_or_gone

log = logging.getLogger("trt_diffusion.openai_api")
DEFAULT_GUIDANCE = 7.5  # the CLI's default (ImageRequest)
MAX_RANDOM_SEED = 2**31  # a seed the request left out: drawn below this, returned in the response
FORM_FILES = ("image", "image[]", "mask")
MAX_FORM_FIELDS = 32


def create_app(settings: ApiSettings):
    settings.check()
    decodes = pngs.DecodeSlots(settings.max_decodes)
    jobs = _open_job_store(settings)
    # the wait is spread over the model's instances as Triton's config declares them (read by JobSlots)
    gate = OverloadGate(dict(settings.overload), settings.cost_model,
                        instances=lambda model: app.state.slots.known_instances(model)) if settings.overload else None

    async def run_job_line(endpoint: str, body: dict) -> dict:
        """A batch line, through its online route's entry (batch_routes.BATCH_ENDPOINTS), at batch priority; an
        edit line's images are read back from its batch's input file (batch_routes.edit_line_body)."""
        if endpoint == batch_routes.EDITS:
            body = await asyncio.to_thread(batch_routes.edit_line_body, jobs, body)
            edit, image, mask = bodies.edit_from_json(body)
            return await edit_response(app.state.jobs, settings, decodes, edit, image, mask, interactive=False)
        return await generation_response(app.state.jobs, settings, json.dumps(body).encode(), interactive=False)

    async def job_slot_free(model: str | None) -> bool:
        if model is None:  # the only model served, when there is one
            try:
                model = (await app.state.catalog.resolve(None)).name
            except ApiError:
                return True
        return await app.state.slots.free(model)

    @asynccontextmanager
    async def lifespan(app):
        # one client over Triton's replicas (one or more): each call to a ready one, the least loaded (its Triton
        # queue read from its metrics, when given, and this API's calls), retried on another when its replica is
        # unavailable (replicas.py)
        client = ReplicaClient(settings.triton_urls(), metrics_urls=settings.replica_metrics_urls()).start()
        app.state.triton = client
        app.state.catalog = Catalog(client, max_age_s=settings.catalog_max_age_s)
        app.state.overload = gate
        app.state.slots = JobSlots(client)
        # what the jobs see: the same catalog, Triton at batch priority with the jobs' deadline, no overload
        # policy, no instance count
        app.state.jobs = SimpleNamespace(triton=BatchPriorityClient(client, settings.job_timeout_s),
                                         catalog=app.state.catalog)
        if jobs is not None:  # the batches left by the last run go on first
            app.state.runner = JobRunner(jobs, run_job_line, slot_free=job_slot_free,
                                         run_video=video_routes.video_runner(app.state.jobs, settings)).start()
            app.state.slots.on_leave = app.state.runner.wake
        try:
            yield
        finally:
            if jobs is not None:
                await app.state.runner.stop()
            await client.close()

    async def authorize(request: Request) -> None:
        """With --api-key, every route needs `Authorization: Bearer <key>` (compared in constant time)."""
        if settings.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`", code="invalid_api_key")

    app = FastAPI(title="trt-diffusion OpenAI Images API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, dependencies=[Depends(authorize)])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status, headers=getattr(err, "headers", None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):  # unknown route, wrong method
        return JSONResponse(ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}").body(),
                            status_code=err.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, err: ClientDisconnect):  # one line: nothing went wrong here
        log.warning("%s %s: the client disconnected before its request arrived whole", request.method,
                    request.url.path)
        return JSONResponse(ApiError(499, "the client disconnected").body(), status_code=499)

    from tritonclient.utils import InferenceServerException

    @app.exception_handler(InferenceServerException)
    async def triton_error(request: Request, err: InferenceServerException):
        if "UNAVAILABLE" in str(err.status() or ""):  # Triton unreachable (a catalog read, /health): 503 as
            # docs/triton.md says, one log line, not a bug of ours
            log.warning("%s %s: Triton is unavailable (%s)", request.method, request.url.path, err.message())
            return JSONResponse(ApiError(503, "Triton is unavailable").body(), status_code=503)
        return await internal_error(request, err)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        # its kind only, as Triton's models answer (docs/security.md): a message can carry the server's paths
        return JSONResponse(ApiError(500, f"internal error ({type(err).__name__}); the server log has the "
                                          "details").body(), status_code=500)

    @app.get("/health")
    async def health(request: Request):
        live = await request.app.state.triton.is_server_live()
        if not live:
            raise ApiError(503, "Triton is not live")
        return {"status": "ok", "replicas": request.app.state.triton.state(), "decodes": decodes.state(),
                "overload": gate.state() if gate is not None else {},
                "jobs": {"waiting_for_an_instance": getattr(getattr(request.app.state, "runner", None),
                                                            "waiting_for_slot", False)}}

    @app.get("/v1/models")
    async def models(request: Request):
        served = await request.app.state.catalog.models()
        return {"object": "list", "data": [_model_card(m) for m in served.values()]}

    @app.get("/v1/models/{name}")
    async def model(request: Request, name: str):
        return _model_card(await request.app.state.catalog.resolve(name))

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        _json_only(request)
        return _with_degraded_header(await generation_response(request.app.state, settings, await request.body(),
                                                               wait=partial(until_done_or_gone, request)))

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        if _content_type(request) == "application/json":  # OpenAI's JSON form: the image as a data URL
            body, image, mask = bodies.parse_edit_json(await request.body())
        else:
            fields, files = await _read_form(request)
            body, image, mask = bodies.parse_edit(fields), files["image"], files.get("mask")
        return _with_degraded_header(await edit_response(request.app.state, settings, decodes, body, image, mask,
                                                         wait=partial(until_done_or_gone, request)))

    def job_store():
        if jobs is None:
            raise ApiError(404, "jobs are off: this API was started without a state folder (--state-dir)",
                           code="jobs_off")
        return jobs

    batch_routes.add_routes(app, job_store, lambda: app.state.runner)
    video_routes.add_routes(app, settings, job_store, lambda: app.state.runner, decodes)
    return BrowserGuard(BodyLimit(app, settings.max_body_bytes, settings.body_timeout_s), settings)


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


def _json_only(request: Request) -> None:
    """A JSON route reads only `application/json`: a browser may send text/plain (or a form) from any page without
    asking first, so taking those as JSON would let any page drive the API (415 instead)."""
    content_type = request.headers.get("content-type", "")
    if _content_type(request) != "application/json":
        raise ApiError(415, f"{request.url.path} takes application/json, got "
                            f"{content_type or 'no content type'!r}", code="unsupported_media_type")


def _checked_loras(loras: list) -> str:
    """The request's loras as the LORAS JSON the entry takes, checked here against the entry's own limits (its
    bytes, count, names and scales: docs/triton.md) so a refused value never travels to Triton."""
    from ..errors import RuntimeInputError
    from ..triton import lora_sets

    try:
        # compact, as Triton will get it: the byte limit is the entry's, on the same string
        return lora_sets.to_json(lora_sets.parse_loras(json.dumps(loras, allow_nan=False, separators=(",", ":"))))
    except (RuntimeInputError, ValueError, OverflowError) as err:
        message = str(err).replace("LORAS", "loras", 1)
        raise bad_request(message if message.startswith("loras") else f"loras: {message}", "loras") from None


def _model_card(model: ServedModel) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "trt-diffusion",
            "family": model.family, "sizes": list(model.sizes), "workflows": list(model.workflows)}


async def _read_form(request) -> tuple[dict[str, str], dict[str, bytes]]:
    """(text fields, files) of a multipart edit request: one image, an optional mask."""
    content_type = request.headers.get("content-type", "")
    if _content_type(request) != "multipart/form-data":
        raise ApiError(415, f"/v1/images/edits takes multipart/form-data (an image file and fields) or "
                            f"application/json (the image as a data URL), got {content_type or 'no content type'!r}")
    form = await request.form(max_files=len(FORM_FILES), max_fields=MAX_FORM_FIELDS)
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    for key, value in form.multi_items():
        if isinstance(value, str):
            if key in fields or key in FORM_FILES:
                raise bad_request(f"field {key!r} is given twice or as text; give it once", key)
            fields[key] = value
            continue
        name = "image" if key == "image[]" else key
        if name not in ("image", "mask"):
            raise bad_request(f"unknown file field {key!r}; this endpoint takes the files image and mask", key)
        if name in files:
            raise bad_request(f"one {name} per request: several were sent", name)
        files[name] = await value.read()
    if "image" not in files:
        raise bad_request("image is required (a PNG file field)", "image")
    return fields, files


def _edit_workflow(served: ServedModel, has_mask: bool) -> str:
    """inpaint with a mask; img2img without one (a Kontext model: edit); refused when the model lacks it."""
    wanted = ["inpaint"] if has_mask else ["img2img", "edit"]
    for workflow in wanted:
        if workflow in served.workflows:
            return workflow
    what = "a mask (inpaint)" if has_mask else "no mask (img2img)"
    raise bad_request(f"{served.name} does not serve edits with {what}: it serves {', '.join(served.workflows)} "
                      "(package it with `workflows:` in engines.yaml listing it)", "mask" if has_mask else "image")


def _open_job_store(settings: ApiSettings):
    """The job store under settings.state_dir (None: jobs are off); ServeError naming the folder when it cannot be
    used (a corrupt store is never replaced silently)."""
    if settings.state_dir is None:
        return None
    from ..errors import ServeError
    from .job_store import SqliteJobStore, StateError

    try:
        return SqliteJobStore(settings.state_dir, settings.state_max_bytes, settings.state_retention_s)
    except StateError as err:
        raise ServeError(err.message) from None


async def generation_response(state, settings: ApiSettings, raw: bytes, wait=None,
                              interactive: bool = True) -> dict:
    """POST /v1/images/generations' answer to the JSON body `raw`: the one entry of the online route and of the
    batch lines (job_runner), so both check, refuse and answer alike. `wait` wraps the Triton call (the online
    route: cancelled when its client goes away); `interactive`: someone waits on it (the overload policy applies)."""
    body = bodies.parse_generation(raw)
    served = await state.catalog.resolve(body.model)
    width, height = check_size(body.size, served)
    return await _generate(state, settings, served, body, width, height, wait=wait, interactive=interactive)


async def edit_response(state, settings: ApiSettings, decodes: pngs.DecodeSlots, body: bodies.EditBody,
                        image_data: bytes, mask_data: bytes | None, wait=None, interactive: bool = True) -> dict:
    """POST /v1/images/edits' answer once its image and mask bytes are read (a multipart form's files, the JSON
    form's data URLs): the one entry of the online route, in either form, and of the batch lines."""
    served = await state.catalog.resolve(body.model)

    def served_size(width: int, height: int) -> None:  # from the image's header, before its pixels
        size = f"{width}x{height}"
        if body.size is not None and body.size != size:
            raise bad_request(f"size {body.size} differs from the image's {size}: images are not resized (send "
                              "the image at a served size)", "size")
        check_size(size, served)

    image, mask = await decodes.run(pngs.read_edit_inputs, image_data, mask_data, served_size)
    height, width = image.shape[:2]
    workflow = _edit_workflow(served, mask is not None)
    return await _generate(state, settings, served, body, width, height, wait=wait, interactive=interactive,
                           workflow=workflow, init_image=image, mask=mask, strength=body.strength)


def _with_degraded_header(result: dict):
    """The answer, with `x-trt-diffusion-degraded` saying what the overload policy lowered, when it did."""
    if result.get("degraded") is None:
        return result
    return JSONResponse(result, headers={DEGRADED_HEADER: result["degraded"]})


async def _generate(state, settings: ApiSettings, served: ServedModel, body, width: int, height: int, wait=None,
                    interactive: bool = True, **image_inputs):
    check_n(body.n, served)
    loras = None
    if body.loras is not None:
        if not served.takes_loras:
            raise bad_request(f"loras: {served.name} takes no LoRAs per request (its entry has no LORAS input)",
                              "loras")
        loras = _checked_loras(body.loras)
    seed = body.seed if body.seed is not None else secrets.randbelow(MAX_RANDOM_SEED)
    if seed + body.n - 1 > bodies.MAX_SEED:  # image i reports seed + i: each must be a seed a request can send
        raise bad_request(f"seed {seed} with n={body.n} would give image seeds up to {seed + body.n - 1}, beyond "
                          f"{bodies.MAX_SEED} (SEED is INT64): use a seed of at most {bodies.MAX_SEED - body.n + 1}",
                          "seed")
    guidance = body.guidance_scale if body.guidance_scale is not None else DEFAULT_GUIDANCE
    gate = getattr(state, "overload", None) if interactive else None
    steps, admission = body.num_inference_steps, None
    if gate is not None:  # may lower the steps or the size, or refuse (429 with Retry-After)
        slots = getattr(state, "slots", None)
        if slots is not None:
            try:  # the instance count the wait is divided by (cached a few seconds)
                await slots.instances(served.name)
            except Exception:  # noqa: BLE001 - unreadable: the last count read, or 1
                log.warning("the instance count of %s could not be read for the overload policy", served.name)
        admission = gate.admit(served.name, f"{width}x{height}", steps, body.n, served.sizes,
                               resizable=not image_inputs)
        steps = admission.steps
        width, height = (int(side) for side in admission.size.split("x"))
    image_request = ImageRequest(body.prompt, height, width, steps=steps,
                                 guidance_scale=guidance, seed=seed, negative_prompt=body.negative_prompt,
                                 num_images=body.n, loras=loras, **image_inputs)
    tensors = image_request.tensors()
    work = infer_images(state.triton, served.name, tensors, settings.timeout_s)
    finished = False
    slots = getattr(state, "slots", None) if interactive else None
    if slots is not None:  # counted: a job line starts only while it leaves people an instance (job_slots)
        slots.enter(served.name)
    try:
        images = await (wait(work) if wait is not None else work)
        finished = True
    finally:
        if admission is not None:
            gate.release(admission, finished)
        if slots is not None:
            slots.leave(served.name)
    if images.shape[0] != body.n:
        raise ApiError(502, f"Triton's {served.name} answered {images.shape[0]} images for n={body.n}")
    strength = image_inputs.get("strength")
    data = []
    for index, image in enumerate(images):
        parameters = ImageParameters(body.prompt, width, height, steps, guidance, seed + index,
                                     body.negative_prompt, model=served.name, workflow=image_inputs.get("workflow"),
                                     strength=strength)
        data.append({"b64_json": base64.b64encode(pngs.encode_png(image, parameters)).decode("ascii"),
                     "revised_prompt": None, "seed": seed + index})
    answer = {"created": int(time.time()), "data": data, "output_format": "png", "size": f"{width}x{height}"}
    if admission is not None and admission.degraded is not None:
        answer["degraded"] = admission.degraded  # the header's words, also in the body (batch output lines)
    return answer
