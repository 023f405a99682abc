"""Ports the server picks itself: `free_port()` frees the port it found before tritonserver binds it, so another
process can take it in between. The server is then started again on other ports. A real tritonserver on an
empty repository (a second or two per start)."""

from __future__ import annotations

import socket

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import stage
from trt_diffusion.triton.server import free_port

pytestmark = pytest.mark.triton


@pytest.fixture
def taken_port():
    """A port another process holds (listening), as after losing the race to it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def empty_repo(tmp_path):
    (tmp_path / "repo").mkdir()
    return tmp_path / "repo"


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(monkeypatch, taken_port, empty_repo,
                                                                         tmp_path):
    picks = iter([taken_port])
    picked: list[int] = []

    def racing_free_port() -> int:  # the first pick loses the race; the check before start still passed
        picked.append(next(picks, None) or free_port())
        return picked[-1]

    monkeypatch.setattr(stage, "free_port", racing_free_port)
    monkeypatch.setattr(stage, "port_is_free", lambda port: True)
    server, _ = stage.start_server(empty_repo, tmp_path / "work", (None, None, None), 60, False)
    try:
        assert server.is_alive()
        assert server.ports.http != taken_port and server.ports.http in picked
        assert picked[0] == taken_port and len(picked) == 6  # two rounds of three ports: one retry
    finally:
        server.stop()


def test_a_port_the_user_chose_is_not_replaced(monkeypatch, taken_port, empty_repo, tmp_path):
    monkeypatch.setattr(stage, "port_is_free", lambda port: True)  # taken after the check: tritonserver says so
    with pytest.raises(ServeError, match=f"127.0.0.1:{taken_port}' already in use"):
        stage.start_server(empty_repo, tmp_path / "work", (taken_port, None, None), 60, False)


def test_a_busy_port_the_user_chose_is_refused_before_starting(taken_port, empty_repo, tmp_path):
    with pytest.raises(ServeError, match=f"http port {taken_port} already in use on 127.0.0.1"):
        stage.start_server(empty_repo, tmp_path / "work", (taken_port, None, None), 60, False)
