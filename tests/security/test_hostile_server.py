"""A hostile server for `generate --url` / `preflight --url` (issue 32, finding 8): the --timeout is one deadline
for the whole request (a trickle of a byte at a time cannot hold the client), replies are capped before they
are read, sizes a server declares are bounded before anything is allocated for them, and a malformed reply is
one ServeError. The server is a real HTTP server on 127.0.0.1 speaking Triton's HTTP paths."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.preflight.connect import _models
from trt_diffusion.triton.client import ImageRequest, RequestCancelled, connect, generate_images, served_sizes

ENTRY_CONFIG = {"name": "p", "parameters": {"trt_diffusion_role": {"string_value": "entry"},
                                            "request_sizes": {"string_value": "64x64"}}}


class Hostile:
    """Replies by path: (status, body bytes) or a callable(handler) that writes the reply itself."""

    def __init__(self):
        self.replies: dict[str, object] = {}
        self.stop = threading.Event()

        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self):
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                path = self.path.split("?")[0]
                reply = outer.replies.get(path, (404, b'{"error": "unknown"}'))
                if callable(reply):
                    reply(self, outer.stop)
                    return
                status, body = reply
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _reply

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    server = Hostile()
    yield server
    server.close()


def _index(*names):
    return (200, json.dumps([{"name": n, "state": "READY"} for n in names]).encode())


def _trickle(handler, stop):
    """Headers promising a body, then one byte every 0.2 s (for at most 15 s)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", "100")
    handler.end_headers()
    for _ in range(75):
        if stop.wait(0.2):
            return
        try:
            handler.wfile.write(b" ")
            handler.wfile.flush()
        except OSError:
            return


@pytest.mark.timeout(60)
def test_the_timeout_is_one_deadline_for_the_whole_request(hostile):
    hostile.replies["/v2/repository/index"] = _trickle
    # the event, not a wall-clock bound: the client gave up on its deadline while the trickle still had bytes
    # to send (it would have ended the exchange with a short body, a different error, after 15 s)
    with pytest.raises(RequestCancelled, match=r"did not complete within its 1 s deadline"):
        generate_images(hostile.url, ImageRequest("x", 64, 64), protocol="http", timeout_s=1.0)


def test_a_reply_larger_than_the_cap_is_refused_before_it_is_read(hostile):
    def huge(handler, stop):
        handler.send_response(200)
        handler.send_header("Content-Length", str(200 << 20))
        handler.end_headers()
        try:
            for _ in range(200):
                handler.wfile.write(b"\0" * (1 << 20))
        except OSError:
            pass

    hostile.replies["/v2/repository/index"] = huge
    with pytest.raises(ServeError, match=r"declares 209715200 bytes, more than the 67108864"):
        generate_images(hostile.url, ImageRequest("x", 64, 64), protocol="http", timeout_s=30.0)


def test_a_reply_without_a_length_is_cut_at_the_cap(hostile):
    def chunked(handler, stop):
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for _ in range(8):
                handler.wfile.write(b"100000\r\n" + b" " * 0x100000 + b"\r\n")
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass

    hostile.replies["/v2/repository/index"] = chunked
    client = connect(hostile.url, "http", 30.0, max_response_bytes=2 << 20)
    try:
        with pytest.raises(ServeError, match=r"larger than 2097152 bytes"):
            client.get_model_repository_index()
    finally:
        client.close()


def test_a_declared_size_is_bounded_before_anything_is_made_for_it(hostile):
    config = json.loads(json.dumps(ENTRY_CONFIG))
    config["parameters"]["request_sizes"]["string_value"] = "40000x40000"
    hostile.replies["/v2/repository/index"] = _index("p")
    hostile.replies["/v2/models/p/config"] = (200, json.dumps(config).encode())
    with pytest.raises(ServeError, match=r"declares request size '40000x40000', beyond 8192 pixels a side"):
        served_sizes(hostile.url, protocol="http")
    config["parameters"]["request_sizes"]["string_value"] = "big"
    hostile.replies["/v2/models/p/config"] = (200, json.dumps(config).encode())
    with pytest.raises(ServeError, match=r"declares request size 'big', which is not WIDTHxHEIGHT"):
        served_sizes(hostile.url, protocol="http")


@pytest.mark.parametrize("index", [b'{"models": 3}', b'[1, 2]', b'[{"nam": "p"}]', b'"text"'])
def test_a_malformed_index_is_one_serve_error(hostile, index):
    hostile.replies["/v2/repository/index"] = (200, index)
    with pytest.raises(ServeError, match=r"malformed reply|serves 0 trt-diffusion pipelines"):
        generate_images(hostile.url, ImageRequest("x", 64, 64), protocol="http", timeout_s=10.0)
    client = connect(hostile.url, "http", 10.0)
    try:
        try:
            assert _models(client, "http", hostile.url) == {}  # rows without a name are no models
        except ServeError as err:
            assert "malformed reply" in str(err) or "cannot read its repository index" in str(err)
    finally:
        client.close()


@pytest.mark.parametrize("config", [b"[1]", b'{"parameters": [1]}', b'{"parameters": {"a": 3}}'])
def test_a_malformed_config_is_one_serve_error(hostile, config):
    hostile.replies["/v2/repository/index"] = _index("p")
    hostile.replies["/v2/models/p/config"] = (200, config)
    client = connect(hostile.url, "http", 10.0)
    try:
        with pytest.raises(ServeError, match=r"malformed reply to the config of p"):
            _models(client, "http", hostile.url)
    finally:
        client.close()


@pytest.mark.parametrize("outputs", [
    [{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 64, 64, 3], "data": [1, 2]}],  # too few values
    [{"name": "IMAGE", "datatype": "NOPE", "shape": [1, 2], "data": [1, 2]}],
    [{"name": "IMAGE", "datatype": "UINT8", "shape": "x", "data": [1]}],
    "not a list",
])
def test_a_malformed_image_reply_is_one_serve_error(hostile, outputs):
    hostile.replies["/v2/repository/index"] = _index("p")
    hostile.replies["/v2/models/p/config"] = (200, json.dumps(ENTRY_CONFIG).encode())
    hostile.replies["/v2/models/p/infer"] = (200, json.dumps({"model_name": "p", "outputs": outputs}).encode())
    with pytest.raises(ServeError, match=r"Triton at .*(malformed reply|expected IMAGE)"):
        generate_images(hostile.url, ImageRequest("x", 64, 64), protocol="http", timeout_s=10.0)
