"""The API's HTTP layer over a real uvicorn, refusals that never reach Triton (none runs here): the key, the body
cap, malformed bodies, the wrong content type, unknown routes — each in OpenAI's error shape, the server up after."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from trt_diffusion.openai_api.server import ApiServer
from trt_diffusion.openai_api.settings import ApiSettings

KEY = "secret-key"
CAP = 4096


@pytest.fixture(scope="module")
def api():
    # Triton is unreachable: every answer below must come before the API would call it
    with ApiServer(ApiSettings("127.0.0.1:9", port=0, api_key=KEY, max_body_bytes=CAP)) as server:
        yield server


def call(api, path: str, body: bytes | None = None, *, key: str | None = KEY, content_type="application/json",
         method: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(api.url.removesuffix("/v1") + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_binds_loopback_by_default(api):
    assert api.url.startswith("http://127.0.0.1:")


@pytest.mark.parametrize("key", [None, "wrong", ""])
def test_a_missing_or_wrong_key_is_401(api, key):
    status, body = call(api, "/v1/images/generations", b'{"prompt": "a"}', key=key)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(api, "/v1/models", key=key)[0] == 401


def test_bodies_past_the_cap_are_413(api):
    status, body = call(api, "/v1/images/generations", json.dumps({"prompt": "x" * CAP}).encode())
    assert status == 413
    assert body["error"]["message"].startswith(f"the request body is {CAP + 14} bytes; this server takes at most "
                                               f"{CAP} bytes")


def test_malformed_requests_are_400_in_openai_shape(api):
    status, body = call(api, "/v1/images/generations", b'{"prompt": "a", "steps": 4}')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "steps"
    assert "unknown field 'steps'" in body["error"]["message"]
    assert call(api, "/v1/images/generations", b"nope")[1]["error"]["message"].startswith("the body is not JSON")
    status, body = call(api, "/v1/images/edits", b'{"prompt": "a"}')  # OpenAI's JSON form: its image is missing
    assert status == 400 and body["error"]["message"].startswith("images is required: images: [{\"image_url\"")
    status, body = call(api, "/v1/images/edits", b'{"prompt": "a"}', content_type="text/plain")
    assert status == 415 and "takes multipart/form-data (an image file and fields) or application/json" in body[
        "error"]["message"]


def test_unknown_routes_and_methods_answer_in_openai_shape(api):
    status, body = call(api, "/v1/chat/completions", b"{}")
    assert status == 404 and body["error"]["message"] == "POST /v1/chat/completions: Not Found"
    assert call(api, "/v1/images/generations", method="GET")[0] == 405


def test_triton_unreachable_is_503_and_the_api_stays_up(api):
    status, body = call(api, "/v1/models")
    assert status == 503 and body["error"]["message"] == "Triton is unavailable", body  # docs/triton.md's 503
    assert call(api, "/health")[0] == 503
    assert call(api, "/v1/images/generations", b'{"prompt": "a", "n": 0}')[0] == 400  # still serving
