"""OpenAI's Files and Batch routes over the job store: POST /v1/files (purpose batch), GET /v1/files/{id},
GET /v1/files/{id}/content, POST /v1/batches, GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel.

An uploaded file is checked line by line as it arrives (each line a JSON object with custom_id, method POST, a
served url and a body object): a malformed line is refused then, naming its number, not found hours later. The
bodies themselves are checked when their line runs, by the same entry the online route uses, so a line the online
API would refuse fails with the online message, in the batch's error file.

An edit line's body is OpenAI's JSON form of an edit (`images: [{"image_url": "data:image/png;base64,..."}]`, an
optional `mask`: bodies.edit_from_json), as the online route also takes it. Its images are not copied into the
store's lines: the line keeps only its model, its seed and where its body is in the batch's input file (kept while
the batch runs), and the body is read back from there when the line runs (edit_line_body)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from . import bodies
from .errors import ApiError, bad_request
from .job_store import JobStore, StateError

GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"  # OpenAI's JSON form of an edit: the images as data URLs in the line
BATCH_ENDPOINTS = (GENERATIONS, EDITS)
INPUT_LINE = "input_line"  # a stored edit line's body: where its request is in the batch's input file
MAX_LINES = 50_000  # OpenAI's own bound on a batch file
MAX_CUSTOM_ID = 512
MAX_WINDOW_H = 7 * 24
MAX_LIST = 100
MAX_RANDOM_SEED = 2**31  # as the online route draws a seed the request left out (app.MAX_RANDOM_SEED)
LINE_KEYS = ("custom_id", "method", "url", "body")


def check_batch_file(content: bytes) -> list[dict]:
    """The request lines of a batch input file; 400 naming the first bad line and what is wrong with it."""
    return [line for line, _ in _batch_lines(content)]


def _batch_lines(content: bytes) -> list[tuple[dict, tuple[int, int]]]:
    """(line, its (byte offset, byte length) in `content`) of each request line; 400 as check_batch_file."""
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the file is not UTF-8 text (byte {exc.start}): a batch file is JSONL", "file") from None
    lines, seen, offset = [], set(), 0
    # JSONL lines end at "\n" only: str.splitlines would also split at U+2028, U+0085…, which JSON strings may hold
    # (split as bytes: in UTF-8 no character but "\n" holds the byte 0x0A, so each piece decodes on its own)
    for number, piece in enumerate(content.split(b"\n"), 1):
        span, offset = (offset, len(piece)), offset + len(piece) + 1
        raw = piece.decode("utf-8").removesuffix("\r")
        if not raw.strip():
            continue
        where = f"line {number} of the file"
        try:
            line = bodies.load_json(raw, where, "file")
        except ApiError as err:
            raise bad_request(err.message, "file") from None
        if not isinstance(line, dict):
            raise bad_request(f"{where} is not a JSON object (it is a {type(line).__name__}); each line is "
                              '{"custom_id", "method", "url", "body"}', "file")
        unknown = sorted(set(line) - set(LINE_KEYS))
        if unknown:
            raise bad_request(f"{where}: unknown key {unknown[0]!r}; a line has {', '.join(LINE_KEYS)}", "file")
        missing = [key for key in LINE_KEYS if key not in line]
        if missing:
            raise bad_request(f"{where}: {missing[0]} is required", "file")
        custom_id = line["custom_id"]
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            raise bad_request(f"{where}: custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} "
                              f"characters, got {custom_id!r:.80}", "file")
        if custom_id in seen:
            raise bad_request(f"{where}: custom_id {custom_id!r} is used twice; each line needs its own", "file")
        seen.add(custom_id)
        if line["method"] != "POST":
            raise bad_request(f"{where}: method must be POST, got {line['method']!r:.40}", "file")
        if line["url"] not in BATCH_ENDPOINTS:
            raise bad_request(f"{where}: url {line['url']!r:.80} is not served in batches; served: "
                              f"{', '.join(BATCH_ENDPOINTS)}", "file")
        if not isinstance(line["body"], dict):
            raise bad_request(f"{where}: body must be a JSON object (the request's body), got "
                              f"{type(line['body']).__name__}", "file")
        lines.append((line, span))
        if len(lines) > MAX_LINES:
            raise bad_request(f"the file has more than {MAX_LINES} requests; split it into several batches", "file")
    if not lines:
        raise bad_request("the file holds no request lines", "file")
    return lines


def edit_line_body(store: JobStore, stored: dict) -> dict:
    """The body of a stored edit line as its input file holds it, with the seed stored at submission: what the
    line runs with. StateError when the input file no longer holds it (removed or changed by hand). Blocking (a
    read of the file): the runner calls it in a worker thread."""
    where = stored[INPUT_LINE]
    path = store.file_content_path(where["file_id"])
    with open(path, "rb") as stream:
        stream.seek(where["offset"])
        raw = stream.read(where["length"])
    try:
        line = json.loads(raw)
        body = dict(line["body"])
    except (ValueError, TypeError, KeyError):
        raise StateError(f"the batch input file {where['file_id']} no longer holds a request at byte "
                         f"{where['offset']}: it was changed by hand") from None
    body["seed"] = stored["seed"]
    return body


def window_seconds(window: object) -> int:
    """`completion_window` ("24h", any whole number of hours up to a week) in seconds; 400 otherwise."""
    match = re.fullmatch(r"([1-9][0-9]{0,2})h", window) if isinstance(window, str) else None
    if match is None or int(match.group(1)) > MAX_WINDOW_H:
        raise bad_request(f"completion_window must be hours like '24h' (1h to {MAX_WINDOW_H}h), got {window!r:.40}",
                          "completion_window")
    return int(match.group(1)) * 3600


def _metadata(value: object) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise bad_request("metadata must be an object of at most 16 string keys (64 characters) and string values "
                          "(512 characters)", "metadata")
    return value


def add_routes(app: FastAPI, store: Callable[[], JobStore], runner: Callable[[], object]) -> None:
    """The routes, on `app` (behind its key and guards). `store()` is the job store (ApiError when jobs are off),
    `runner()` the background runner to wake and to stop a cancelled batch's running line."""

    @app.post("/v1/files")
    async def create_file(request: Request):
        content_type = request.headers.get("content-type", "")
        if content_type.partition(";")[0].strip().lower() != "multipart/form-data":
            raise ApiError(415, f"/v1/files takes multipart/form-data (a file and its purpose), got "
                                f"{content_type or 'no content type'!r}")
        jobs = store()
        form = await request.form(max_files=1, max_fields=4)
        purpose = form.get("purpose")
        if purpose != "batch":
            raise bad_request(f"purpose {purpose!r:.40} is not served: files here are batch inputs (purpose "
                              "batch)", "purpose")
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise bad_request("file is required (the JSONL file, as a file field)", "file")
        content = await upload.read()
        check_batch_file(content)
        filename = (upload.filename or "batch.jsonl").replace("/", "_")[-255:]
        return jobs.add_file("batch", filename, content).card()

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str):
        return store().file(file_id).card()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        # streamed from disk: an output file of thousands of images is never read whole into memory
        return FileResponse(store().file_content_path(file_id), media_type="application/jsonl")

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        if request.headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
            raise ApiError(415, "/v1/batches takes application/json")
        data = bodies.load_json(await request.body())
        if not isinstance(data, dict):
            raise bad_request(f"the body must be a JSON object, got {type(data).__name__}")
        known = ("input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(known)}", unknown[0])
        for field in ("input_file_id", "endpoint", "completion_window"):
            if field not in data:
                raise bad_request(f"{field} is required", field)
        endpoint = data["endpoint"]
        if endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"endpoint {endpoint!r:.80} is not served in batches; served: "
                              f"{', '.join(BATCH_ENDPOINTS)}", "endpoint")
        window_s = window_seconds(data["completion_window"])
        metadata = _metadata(data.get("metadata"))
        jobs = store()
        if not isinstance(data["input_file_id"], str):
            raise bad_request("input_file_id must be a file id string", "input_file_id")
        source = jobs.file(data["input_file_id"])
        if source.purpose != "batch":
            raise bad_request(f"{source.id} is a {source.purpose} file, not a batch input", "input_file_id")
        lines = []
        for number, (line, (offset, length)) in enumerate(_batch_lines(jobs.file_content(source.id)), 1):
            if line["url"] != endpoint:
                raise bad_request(f"line {number} of {source.id} asks {line['url']}, not the batch's endpoint "
                                  f"{endpoint}", "endpoint")
            body = dict(line["body"])
            if body.get("seed") is None:  # drawn now and stored: a restart runs the line with the same seed
                body["seed"] = secrets.randbelow(MAX_RANDOM_SEED)
            if endpoint == EDITS:  # its images stay in the input file: the line keeps where they are
                body = {**({"model": body["model"]} if "model" in body else {}), "seed": body["seed"],
                        INPUT_LINE: {"file_id": source.id, "offset": offset, "length": length}}
            lines.append((line["custom_id"], body))
        batch = jobs.add_batch(endpoint, source.id, data["completion_window"], window_s, metadata, lines)
        runner().wake()
        return batch

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = 20):
        if not 1 <= limit <= MAX_LIST:
            raise bad_request(f"limit must be in 1..{MAX_LIST}, got {limit}", "limit")
        data, more = store().batches(after, limit)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str):
        return store().batch(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        jobs = store()
        batch = jobs.batch(batch_id)
        if not jobs.set_status(batch_id, "cancelling", only_from=("validating", "in_progress")):
            if batch["status"] in ("cancelling", "cancelled"):
                return jobs.batch(batch_id)
            raise ApiError(409, f"batch {batch_id} is {batch['status']}: there is nothing left to cancel",
                           "batch_id", "batch_not_cancellable")
        if getattr(runner(), "current", None) != batch_id:
            # not the batch the runner works on: nothing runs to stop, so it is cancelled now, not when the runner
            # reaches it behind the batches ahead (synchronously: the runner cannot take it up meanwhile)
            return jobs.finalize(batch_id, "cancelled")
        runner().cancel(batch_id)
        return jobs.batch(batch_id)
