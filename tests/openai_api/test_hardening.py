"""The API's smaller hardening (issue 44, finding 8): a body nested 100,000 deep is a 400; a client that leaves
mid-upload is one log line; an unknown model is answered from the cached catalog; the LoRA limits the entry
documents are checked before Triton is called; and uvicorn's header, body and connection limits hold.

Over the real API (uvicorn in a thread) and raw sockets; Triton is the stand-in of conftest.py, which counts what
reaches it. Timeouts below are hang guards or the server's configured deadlines, never measured durations."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import urllib.error
import urllib.request

import pytest

from trt_diffusion.openai_api import bodies
from trt_diffusion.openai_api.catalog import Catalog
from trt_diffusion.openai_api.errors import ApiError
from trt_diffusion.openai_api.server import ApiServer
from trt_diffusion.openai_api.settings import ApiSettings

GUARD_S = 20
UNREACHABLE = "127.0.0.1:9"  # a Triton nobody answers at: the answers below must come before any call


def post(api, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(api.url.removesuffix("/v1") + path, data=body,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=GUARD_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def connect(api) -> socket.socket:
    return socket.create_connection(("127.0.0.1", api.port), timeout=GUARD_S)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 answer with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), body


# -- a body nested 100,000 deep ------------------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


def test_a_body_nested_100000_deep_is_a_400_naming_the_depth():
    for raw in (DEEP, b'{"prompt": "a", "loras": ' + DEEP + b"}", b'{"prompt": "a", "loras": [' + b"{\"a\": " * 20
                + b"1" + b"}" * 20 + b"]}"):
        with pytest.raises(ApiError) as caught:
            bodies.parse_generation(raw)
        assert caught.value.status == 400 and "nests too deeply (at most 16 levels)" in caught.value.message
    with pytest.raises(ApiError, match="loras nests too deeply") as caught:
        bodies.parse_edit({"prompt": "a", "loras": DEEP.decode()})
    assert caught.value.param == "loras"


def test_a_deep_body_over_http_is_a_400_and_the_server_stays_up():
    with ApiServer(ApiSettings(UNREACHABLE, port=0)) as api:
        status, body = post(api, "/v1/images/generations", b'{"prompt": "a", "loras": ' + DEEP + b"}")
        assert status == 400 and "nests too deeply" in body["error"]["message"], body
        assert post(api, "/v1/images/generations", b'{"prompt": "a", "n": 0}')[0] == 400


# -- a client that leaves during its upload ------------------------------------------------------------------------

class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.arrived = threading.Event()

    def emit(self, record):
        self.records.append(record)
        self.arrived.set()


def test_a_client_that_disconnects_mid_upload_is_one_log_line():
    records = Records()
    loggers = [logging.getLogger(name) for name in ("trt_diffusion.openai_api", "uvicorn.error", "uvicorn")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        with ApiServer(ApiSettings(UNREACHABLE, port=0)) as api:
            for path, kind in (("/v1/images/generations", "application/json"),
                               ("/v1/images/edits", "multipart/form-data; boundary=xyz")):
                records.arrived.clear()
                with connect(api) as sock:
                    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {kind}\r\n"
                                 "Content-Length: 100000\r\n\r\n--xyz\r\n".encode())
                assert records.arrived.wait(GUARD_S), "nothing was logged"
            assert post(api, "/v1/images/generations", b'{"prompt": "a", "n": 0}')[0] == 400  # still serving
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    lines = [(r.name, r.levelname, r.getMessage()) for r in records.records]
    assert lines == [("trt_diffusion.openai_api", "WARNING", "POST /v1/images/generations: the client disconnected "
                                                             "before its request arrived whole"),
                     ("trt_diffusion.openai_api", "WARNING", "POST /v1/images/edits: the client disconnected "
                                                             "before its request arrived whole")], lines
    assert all(r.exc_info is None for r in records.records)  # no traceback


# -- an unknown model name ------------------------------------------------------------------------------------------

def test_unknown_model_names_are_answered_from_the_cached_catalog(stub_triton):
    with ApiServer(ApiSettings(stub_triton.url, port=0)) as api:
        for _ in range(3):
            status, body = post(api, "/v1/images/generations", b'{"prompt": "a", "model": "nope"}')
            assert status == 404 and "model 'nope' is not served; served: sd15-tiny" in body["error"]["message"]
    assert stub_triton.calls["RepositoryIndex"] == 1


def test_the_catalog_is_reread_once_it_is_older_than_its_max_age(stub_triton):
    import tritonclient.grpc.aio as grpc_aio

    async def scenario():
        client = grpc_aio.InferenceServerClient(stub_triton.url)
        now = [100.0]
        catalog = Catalog(client, max_age_s=5.0, clock=lambda: now[0])
        try:
            for _ in range(3):
                with pytest.raises(ApiError, match="model 'nope' is not served"):
                    await catalog.resolve("nope")
            assert stub_triton.calls["RepositoryIndex"] == 1
            now[0] += 4.9
            assert (await catalog.resolve(stub_triton.entry)).sizes == ("64x64",)
            assert stub_triton.calls["RepositoryIndex"] == 1
            now[0] += 0.1  # max age reached: the next request reads Triton again, once
            await asyncio.gather(*(catalog.resolve(stub_triton.entry) for _ in range(4)))
            assert stub_triton.calls["RepositoryIndex"] == 2
        finally:
            await client.close()

    asyncio.run(scenario())


# -- LoRA limits at the API -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("loras, words", [
    ([{"name": "x" * (2 << 20)}], "loras has 2097165 bytes (at most 4096)"),  # counted compact, as Triton gets it
    ([{"name": f"l{i}"} for i in range(9)], "loras lists 9 LoRAs (at most 8)"),
    ([{"name": "style", "scale": 1e30}], "loras[0].scale must be a finite number in [-100, 100], got 1e+30"),
    ([{"name": "style", "weight": 1}], "loras[0] has unknown key(s) ['weight']"),
    ([{"name": "style"}, {"name": "style", "scale": 0.5}], "loras names 'style' twice"),
    ([{"name": "style", "scale": 10 ** 400}], "loras"),
])
def test_loras_past_the_entrys_limits_never_reach_triton(stub_triton, loras, words):
    with ApiServer(ApiSettings(stub_triton.url, port=0)) as api:
        status, body = post(api, "/v1/images/generations", json.dumps({"prompt": "a", "loras": loras}).encode())
        assert status == 400 and words in body["error"]["message"] and body["error"]["param"] == "loras", body
        assert stub_triton.calls["ModelInfer"] == 0
        # a good set goes on to Triton (the stand-in refuses it: there is no engine)
        status, body = post(api, "/v1/images/generations", b'{"prompt": "a", "loras": [{"name": "style"}]}')
        assert status == 400 and "stub triton" in body["error"]["message"]
        assert stub_triton.calls["ModelInfer"] == 1


# -- uvicorn's limits -----------------------------------------------------------------------------------------------

def test_headers_that_never_end_are_cut_off_at_the_header_deadline():
    with ApiServer(ApiSettings(UNREACHABLE, port=0, header_timeout_s=0.2)) as api:
        with connect(api) as silent, connect(api) as trickle:
            trickle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the blank line never comes
            assert silent.recv(1024) == b""  # closed by the server, no answer owed
            assert trickle.recv(1024) == b""
        assert post(api, "/v1/images/generations", b'{"prompt": "a", "n": 0}')[0] == 400


def test_a_body_that_never_arrives_whole_is_a_408():
    with ApiServer(ApiSettings(UNREACHABLE, port=0, body_timeout_s=0.2)) as api:
        for path, kind in (("/v1/images/generations", "application/json"),
                           ("/v1/images/edits", "multipart/form-data; boundary=xyz")):
            with connect(api) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {kind}\r\n"
                             "Content-Length: 1000\r\n\r\n--xyz\r\n".encode())
                status, body = read_response(sock)
            assert status == 408, body
            assert json.loads(body)["error"]["message"] == ("the request body did not arrive whole within 0.2 s; "
                                                            "send it at once")


def test_connections_beyond_the_limit_are_answered_503():
    with ApiServer(ApiSettings(UNREACHABLE, port=0, max_connections=2)) as api:
        with connect(api) as first:
            first.sendall(b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response(first)[0] == 404  # kept alive: it still counts
            with connect(api) as second:
                second.sendall(b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert read_response(second)[0] == 503


# -- a bug's answer ------------------------------------------------------------------------------------------------


def test_a_bug_is_a_500_naming_its_kind_only_not_its_message(monkeypatch, caplog):
    """The catch-all answers a bug with its kind (as Triton's models do, docs/security.md): an exception's text can
    carry the server's paths; the whole traceback goes to the log."""

    def bug(raw):
        raise FileNotFoundError(2, "No such file or directory", "/srv/secret/models/unet.onnx")

    monkeypatch.setattr(bodies, "parse_generation", bug)
    with caplog.at_level(logging.ERROR, logger="trt_diffusion.openai_api"):
        with ApiServer(ApiSettings(UNREACHABLE, port=0)) as api:
            status, answer = post(api, "/v1/images/generations", b'{"prompt": "a fox"}')
    assert status == 500, answer
    assert "FileNotFoundError" in answer["error"]["message"], answer
    assert "/srv/secret" not in json.dumps(answer), answer
    assert "/srv/secret" in caplog.text  # the log keeps what the reply leaves out


def test_a_lora_list_triton_would_take_is_not_refused_for_the_api_own_spacing(stub_triton):
    """The byte limit applies to the compact LORAS Triton receives: 8 names that fit it compact (4096 bytes at
    most) but not with json.dumps' default spaces were refused before."""
    names = [{"name": f"{i}" + "n" * 486, "scale": 1} for i in range(8)]
    compact = json.dumps([{"name": n["name"], "scale": 1.0} for n in names], separators=(",", ":"))
    assert len(compact) <= 4096 < len(json.dumps(names))
    with ApiServer(ApiSettings(stub_triton.url, port=0)) as api:
        status, body = post(api, "/v1/images/generations", json.dumps({"prompt": "a", "loras": names}).encode())
        assert status == 400 and "stub triton" in body["error"]["message"], body  # reached Triton
