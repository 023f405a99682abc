"""`generate --timeout` is one deadline for the whole command (issue 44, finding 4): size discovery
(`served_sizes`), connect, every call, over HTTP and gRPC. Before, `served_sizes` ran on a fixed 60 s, the gRPC
repository-index call had no timeout at all (a gRPC port that accepts and never answers held `generate` for
good) and the HTTP deadline started after size discovery.

- against real sockets on 127.0.0.1: a gRPC port that accepts and never answers, and an HTTP server that trickles
  a byte at a time, with and without --height/--width: exit 1 with "no answer within 1 s" (a hang fails by the
  test's own pytest timeout: nothing here measures time);
- with an injected clock: every call is handed at most what is left of the deadline, and once it has passed no
  further call is made.
"""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.cli import main
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton.client import ImageRequest, RequestCancelled
from trt_diffusion.triton.client_limits import Deadline


class Listener:
    """A TCP port on 127.0.0.1 whose every connection is handed to `serve(connection, stop)` in a thread."""

    def __init__(self, serve):
        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, args=(serve,), daemon=True)
        self.thread.start()

    def _accept(self, serve):
        while not self.stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except OSError:
                continue
            self.connections.append(connection)
            threading.Thread(target=serve, args=(connection, self.stop), daemon=True).start()

    def close(self):
        self.stop.set()
        self.thread.join()
        for connection in self.connections:
            connection.close()
        self.sock.close()


def _silent(connection, stop):
    """Accept, read whatever comes, never answer (a gRPC client waits for the server's HTTP/2 settings)."""
    connection.settimeout(0.1)
    while not stop.is_set():
        try:
            if connection.recv(65536) == b"":
                return
        except OSError:
            continue


def _trickle(connection, stop):
    """Read a request's head, promise a large body, then send it a byte every 0.2 s until stopped."""
    connection.settimeout(0.2)
    head = b""
    while b"\r\n\r\n" not in head and not stop.is_set():
        try:
            chunk = connection.recv(65536)
        except OSError:
            continue
        if not chunk:
            return
        head += chunk
    try:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1048576\r\n\r\n")
        while not stop.wait(0.2):
            connection.sendall(b" ")
    except OSError:
        return


@pytest.fixture
def silent_grpc():
    listener = Listener(_silent)
    yield f"grpc://127.0.0.1:{listener.port}"
    listener.close()


@pytest.fixture
def trickling_http():
    listener = Listener(_trickle)
    yield f"http://127.0.0.1:{listener.port}"
    listener.close()


def generate(capsys, tmp_path, url: str, *sizes: str) -> tuple[int, str]:
    code = main(["generate", "--url", url, "--prompt", "x", "--timeout", "1", *sizes, "-o", str(tmp_path / "o.png")])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


SIZES = {"sizes asked of the server": (), "sizes given": ("--height", "64", "--width", "64")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES)
def test_a_silent_grpc_server_is_given_up_at_the_deadline(silent_grpc, capsys, tmp_path, sizes):
    code, text = generate(capsys, tmp_path, silent_grpc, *sizes)
    assert code == 1, text
    assert "no answer within 1 s" in text and "Traceback" not in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES)
def test_a_trickling_http_server_is_given_up_at_the_deadline(trickling_http, capsys, tmp_path, sizes):
    code, text = generate(capsys, tmp_path, trickling_http, *sizes)
    assert code == 1, text
    assert "no answer within 1 s" in text and "Traceback" not in text


# --- an injected clock: what each call is given ------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeGrpcClient:
    """tritonclient.grpc's calls as served_sizes and generate_images make them: each records the client_timeout
    it was given and the time left then, and costs `cost` seconds of the injected clock."""

    def __init__(self, clock: Clock, deadline: Deadline, cost: float):
        self.clock, self.deadline, self.cost = clock, deadline, cost
        self.calls: list[tuple[str, float | None, float]] = []  # (call, client_timeout, time left at the call)

    def _called(self, name: str, client_timeout):
        self.calls.append((name, client_timeout, self.deadline.end - self.clock()))
        self.clock.now += self.cost

    def get_model_repository_index(self, client_timeout=None):
        self._called("index", client_timeout)
        return SimpleNamespace(models=[SimpleNamespace(name="p")])

    def get_model_config(self, name, client_timeout=None):
        self._called(f"config {name}", client_timeout)
        parameters = {"trt_diffusion_role": SimpleNamespace(string_value="entry"),
                      "request_sizes": SimpleNamespace(string_value="64x64")}
        return SimpleNamespace(config=SimpleNamespace(parameters=parameters))

    def infer(self, model, inputs, outputs=None, client_timeout=None, parameters=None):
        self._called(f"infer {model}", client_timeout)
        return SimpleNamespace(as_numpy=lambda name: np.zeros((1, 64, 64, 3), np.uint8) if name == "IMAGE" else None,
                               get_response=lambda: SimpleNamespace(parameters={}))

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    def make(cost: float, timeout_s: float = 5.0):
        clock = Clock()
        deadline = Deadline(timeout_s, "grpc://127.0.0.1:8001", clock=clock)
        client = FakeGrpcClient(clock, deadline, cost)
        monkeypatch.setattr(triton_client, "connect", lambda *args, **kwargs: client)
        return deadline, client
    return make


def _check_each_call_got_what_was_left(client: FakeGrpcClient):
    assert client.calls
    for name, given, left in client.calls:
        assert given is not None and 0 < given <= left, (name, given, left)


def test_deadline_counts_down_on_its_clock_and_names_itself_when_passed():
    clock = Clock()
    deadline = Deadline(5, "127.0.0.1:8000", clock=clock)
    assert deadline.left() == 5
    clock.now += 3.5
    assert deadline.left() == 1.5
    clock.now += 1.5
    with pytest.raises(RequestCancelled, match=r"Triton at 127.0.0.1:8000: no answer within 5 s"):
        deadline.left()


def test_size_discovery_and_the_request_share_one_deadline(fake):
    deadline, client = fake(cost=0.5)
    pipeline, sizes = triton_client.served_sizes("127.0.0.1:8001", None, "grpc", deadline=deadline)
    assert (pipeline, sizes) == ("p", ["64x64"])
    triton_client.generate_images("127.0.0.1:8001", ImageRequest("x", 64, 64), pipeline=pipeline, protocol="grpc",
                                  timeout_s=5.0, deadline=deadline)
    _check_each_call_got_what_was_left(client)
    assert [name for name, _, _ in client.calls] == ["index", "config p", "config p", "infer p"]
    assert [given for _, given, _ in client.calls] == [5.0, 4.5, 4.0, 3.5]  # one clock, counting down


def test_once_the_deadline_has_passed_no_call_is_made(fake):
    deadline, client = fake(cost=2.5, timeout_s=5.0)
    with pytest.raises(RequestCancelled, match=r"no answer within 5 s"):
        triton_client.generate_images("127.0.0.1:8001", ImageRequest("x", 64, 64), protocol="grpc", timeout_s=5.0,
                                      deadline=deadline)
    _check_each_call_got_what_was_left(client)
    assert [name for name, _, _ in client.calls] == ["index", "config p"]  # 5 s spent: no more calls


def test_size_discovery_alone_is_bounded_by_the_deadline(fake):
    deadline, client = fake(cost=3.0, timeout_s=5.0)
    with pytest.raises(RequestCancelled, match=r"no answer within 5 s"):
        triton_client.served_sizes("127.0.0.1:8001", None, "grpc", deadline=deadline)
    _check_each_call_got_what_was_left(client)
    assert len(client.calls) == 2
