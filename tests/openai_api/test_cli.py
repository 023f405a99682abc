"""`openai-api` and `serve --openai-port` refuse bad settings with one message (exit 1) or a usage line (exit 2),
before anything starts."""

from __future__ import annotations

import socket

import pytest

from trt_diffusion.cli import EXIT_USAGE, main


def run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


@pytest.mark.parametrize("argv, fragment", [
    (["openai-api", "--port", "70000"], "'--port'"),
    (["openai-api", "--max-body-bytes", "10"], "'--max-body-bytes'"),
    (["serve", "--openai-port", "0"], "'--openai-port'"),
])
def test_usage_mistakes(argv, fragment, capsys):
    code, text = run(argv, capsys)
    assert code == EXIT_USAGE and fragment in text and "Traceback" not in text


def test_a_triton_url_it_cannot_speak_is_refused(capsys):
    code, text = run(["openai-api", "--triton-url", "ftp://127.0.0.1:8001"], capsys)
    assert code == 1 and "--triton-url ftp://127.0.0.1:8001: unknown scheme ftp://" in text, text
    code, text = run(["openai-api", "--triton-url", "grpc://127.0.0.1:8001/v2"], capsys)
    assert code == 1 and "a gRPC address is host:port, without a path" in text, text


def test_a_taken_port_is_refused_by_name(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, text = run(["openai-api", "--port", str(port)], capsys)
    assert code == 1 and f"cannot listen on 127.0.0.1:{port} for the OpenAI API" in text, text
    assert "choose another --openai-port" in text
