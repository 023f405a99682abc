"""`serve` and `openai-api` take their own ports again right after a restart (issue 44, finding 8): a port whose
last connection is in TIME_WAIT is free to listen on (tritonserver and uvicorn bind with SO_REUSEADDR), so the
port checks must not refuse it; a port another process listens on is still refused."""

from __future__ import annotations

import socket

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.openai_api.server import check_port
from trt_diffusion.openai_api.settings import ApiSettings
from trt_diffusion.triton import stage


@pytest.fixture
def time_wait_port():
    """A port a server listened on and closed a connection on first, as a stopped server leaves it: the
    connection's server side stays in TIME_WAIT (60 s on Linux). Linux lets a new socket bind beside it only when
    both set SO_REUSEADDR."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as tritonserver and uvicorn listen
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server closes first: its end goes to TIME_WAIT
            assert client.recv(1) == b""
    with socket.socket() as probe:  # the situation under test: a plain bind is refused
        with pytest.raises(OSError):
            probe.bind(("127.0.0.1", port))
    return port


def test_a_port_in_time_wait_is_free_for_serve_and_the_api(time_wait_port):
    assert stage.port_is_free(time_wait_port)
    check_port(ApiSettings("127.0.0.1:8001", port=time_wait_port))


def test_a_port_with_a_listener_is_still_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not stage.port_is_free(port)
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port} for the OpenAI API"):
            check_port(ApiSettings("127.0.0.1:8001", port=port))
