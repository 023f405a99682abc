"""`serve --no-triton-http` (issue 44, finding 6): Triton's HTTP port takes requests a web page can send, like the
API's; without it, tritonserver serves gRPC only (what the OpenAI API and `generate --url grpc://` use), and no
metrics port either. A real tritonserver on an empty repository (a second or two)."""

from __future__ import annotations

import socket

import pytest

from trt_diffusion import api as api_module
from trt_diffusion.cli import main
from trt_diffusion.triton.server import TritonServer


@pytest.fixture
def empty_repo(tmp_path):
    (tmp_path / "repo").mkdir()
    return tmp_path / "repo"


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


def test_the_command_line_has_no_http_or_metrics_port(empty_repo, tmp_path):
    args, _ = TritonServer(empty_repo, tmp_path / "work", http=False).command()
    assert "--allow-http=false" in args and "--allow-metrics=false" in args
    assert not [arg for arg in args if arg.startswith(("--http-", "--metrics-"))]
    assert "--grpc-address=127.0.0.1" in args
    assert any(arg.startswith("--grpc-restricted-protocol=") for arg in args)  # the admin APIs stay closed
    args, _ = TritonServer(empty_repo, tmp_path / "work").command()
    assert "--http-address=127.0.0.1" in args and "--allow-http=false" not in args  # the default is unchanged


@pytest.mark.triton
def test_a_server_without_http_is_ready_over_grpc_alone(empty_repo, tmp_path):
    import tritonclient.grpc as grpc

    server = TritonServer(empty_repo, tmp_path / "work", http=False)
    server.start(timeout_s=120)
    try:
        client = grpc.InferenceServerClient(server.grpc_url)
        try:
            assert client.is_server_ready()
        finally:
            client.close()
        assert refused(server.ports.http) and refused(server.ports.metrics)
        assert server.models_ready([]) == {}
    finally:
        server.stop()


def test_serve_passes_no_triton_http_on(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(api_module, "serve", lambda repo, **options: seen.append(options["triton_http"]))
    assert main(["serve", "--no-triton-http", "--openai-port", "8085"]) == 0
    assert main(["serve"]) == 0
    assert seen == [False, True]
