"""Review findings on the Batch routes through the official client (issue #46): a batch queued behind a running
one is cancelled at once, not left "cancelling" until the runner reaches it; a JSON string holding U+2028 (valid
unescaped JSON) is one line, not split in two; a CORS preflight for DELETE (videos.delete) is allowed; a listing
after an unknown batch is 404."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from trt_diffusion.openai_api.guards import BrowserGuard
from trt_diffusion.openai_api.settings import ApiSettings

HANG_GUARD_S = 60


def client(api):
    import openai

    return openai.OpenAI(base_url=api.url, api_key="x", max_retries=0)


def jsonl(*bodies: dict) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/images/generations",
                               "body": body}, ensure_ascii=False) + "\n" for i, body in enumerate(bodies)).encode()


def test_a_queued_batch_is_cancelled_at_once(api, stub):
    stub.gate = threading.Semaphore(0)
    openai_client = client(api)
    upload = openai_client.files.create(file=("a.jsonl", jsonl({"model": "sd15-tiny", "prompt": "x", "seed": 1})),
                                        purpose="batch")
    running = openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                           completion_window="24h")
    assert stub.entered.wait(HANG_GUARD_S)  # the first batch's line is held inside Triton
    queued = openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                          completion_window="24h")
    cancelled = openai_client.batches.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None  # not waiting for the runner
    assert openai_client.batches.retrieve(running.id).status == "in_progress"
    stub.gate.release(10)


def test_a_line_with_u2028_in_a_string_is_one_line(api):
    openai_client = client(api)
    content = jsonl({"model": "sd15-tiny", "prompt": "a\u2028b\u2029c\x85d", "seed": 1})
    assert "\u2028".encode() in content  # unescaped, as JSON allows
    upload = openai_client.files.create(file=("a.jsonl", content), purpose="batch")
    assert upload.bytes == len(content)


def test_a_listing_after_an_unknown_batch_is_404(api):
    """GET /v1/batches?after=ID pages after that batch (OpenAI's cursor): an ID the store does not hold (a typo, or
    a batch deleted by the retention) is answered 404 by name, not with the first page as if no cursor were given."""
    import openai

    openai_client = client(api)
    upload = openai_client.files.create(file=("a.jsonl", jsonl({"model": "sd15-tiny", "prompt": "x", "seed": 1})),
                                        purpose="batch")
    older, newer = (openai_client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                                 completion_window="24h") for _ in range(2))
    assert [batch.id for batch in openai_client.batches.list(after=newer.id).data] == [older.id]
    with pytest.raises(openai.NotFoundError, match="no batch 'batch_unknown' to list after"):
        openai_client.batches.list(after="batch_unknown")
    with pytest.raises(openai.NotFoundError, match="no video 'video_unknown' to list after"):
        openai_client.videos.list(after="video_unknown")


def test_a_cors_preflight_allows_delete():
    settings = ApiSettings("127.0.0.1:9", cors_origins=("https://app.example.com",))
    sent = []

    async def send(message):
        sent.append(message)

    async def never(scope, receive, send):  # the preflight is answered by the guard itself
        raise AssertionError("reached the app")

    scope = {"type": "http", "method": "OPTIONS", "path": "/v1/videos/video-1",
             "headers": [(b"host", b"127.0.0.1"), (b"origin", b"https://app.example.com"),
                         (b"access-control-request-method", b"DELETE")]}
    asyncio.run(BrowserGuard(never, settings)(scope, None, send))
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 204 and b"DELETE" in headers[b"access-control-allow-methods"]
