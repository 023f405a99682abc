"""`generate --url https://…` speaks TLS, and a scheme the client cannot honour is refused; nothing is sent
as plain text by surprise (issue 20, item 12). A loopback socket records the first bytes each client sends."""

from __future__ import annotations

import socket
import threading

import pytest

from trt_diffusion.cli import main
from trt_diffusion.errors import ServeError
from trt_diffusion.triton import client

TLS_HANDSHAKE = 0x16  # the first byte of a TLS record carrying a ClientHello


class FirstBytes:
    """Accepts connections on 127.0.0.1, keeps the first bytes of each, then hangs up."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(16))
                except OSError:
                    pass

    def close(self):
        self.stopping = True
        self.thread.join()
        self.sock.close()


@pytest.fixture
def listener():
    server = FirstBytes()
    try:
        yield server
    finally:
        server.close()


def _generate(url: str, protocol: str):
    return client.generate(url, protocol=protocol, pipeline="p", prompt="a cat", height=64, width=64, timeout_s=5)


@pytest.mark.parametrize("protocol,scheme", [("http", "https"), ("grpc", "https"), ("grpc", "grpcs")])
def test_https_urls_speak_tls(listener, protocol, scheme):
    with pytest.raises(ServeError):
        _generate(f"{scheme}://127.0.0.1:{listener.port}", protocol)
    assert listener.received and all(data[:1] == bytes([TLS_HANDSHAKE]) for data in listener.received if data), \
        listener.received


@pytest.mark.parametrize("protocol,scheme,plain", [("http", "http://", b"POST"), ("http", "", b"POST"),
                                                   ("grpc", "grpc://", b"PRI *"), ("grpc", "", b"PRI *")])
def test_plain_urls_stay_plain(listener, protocol, scheme, plain):
    with pytest.raises(ServeError):
        _generate(f"{scheme}127.0.0.1:{listener.port}", protocol)
    assert any(data.startswith(plain) for data in listener.received), listener.received


@pytest.mark.parametrize("url,protocol,message", [
    ("ftp://127.0.0.1:1", "http", "unknown scheme ftp://"),
    ("grpc://127.0.0.1:1", "http", "does not speak http"),
    ("grpcs://127.0.0.1:1", "http", "does not speak http"),
    ("grpc://127.0.0.1:1/v2", "grpc", "without a path"),
    ("https://", "http", "no host:port"),
])
def test_a_scheme_that_cannot_be_honoured_is_refused(url, protocol, message):
    with pytest.raises(ServeError, match=message):
        client.connect(url, protocol)


def test_the_command_refuses_it_with_one_message(capsys):
    assert main(["generate", "--url", "ftp://127.0.0.1:1", "--prompt", "a cat", "--height", "64", "--width", "64",
                 "--pipeline", "p"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "unknown scheme ftp://" in captured.err
