"""Triton's shared-memory, trace and logging APIs are closed to clients unless asked for
(issue 20, item 9). A real tritonserver on an empty repository: starts in a second."""

from __future__ import annotations

import pytest

from trt_diffusion.triton.server import TritonServer
from trt_diffusion.triton.stage import start_server

pytestmark = pytest.mark.triton

HTTP_ADMIN = ["get_system_shared_memory_status", "get_cuda_shared_memory_status", "get_trace_settings",
              "get_log_settings"]
GRPC_ADMIN = ["get_system_shared_memory_status", "get_trace_settings", "get_log_settings"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("restricted")
    (root / "repo").mkdir()
    # start_server picks the ports and picks again if another process takes one before tritonserver binds it
    closed, _ = start_server(root / "repo", root / "closed", (None, None, None), 60, admin_apis=False)
    try:
        opened, _ = start_server(root / "repo", root / "open", (None, None, None), 60, admin_apis=True)
        try:
            yield closed, opened
        finally:
            opened.stop()
    finally:
        closed.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_admin_apis_are_refused_by_default(servers, protocol):
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    closed, _ = servers
    module, url, calls = (http, closed.http_url, HTTP_ADMIN) if protocol == "http" else \
        (grpc, closed.grpc_url, GRPC_ADMIN)
    client = module.InferenceServerClient(url)
    try:
        assert client.is_server_live() and client.is_server_ready()  # health and inference stay open
        client.get_inference_statistics()
        client.get_model_repository_index()  # `generate` finds the pipeline through it
        for call in calls:
            with pytest.raises(Exception, match="restricted"):
                getattr(client, call)()
            getattr(client, call)(headers=closed.admin_headers(protocol))  # the server's owner can
    finally:
        client.close()


def test_model_loading_stays_refused(servers):
    import tritonclient.http as http

    closed, _ = servers
    client = http.InferenceServerClient(closed.http_url)
    try:
        with pytest.raises(Exception, match="explicit model load / unload is not allowed"):
            client.load_model("anything")
    finally:
        client.close()


def test_admin_apis_are_open_when_asked_for(servers):
    import tritonclient.http as http

    _, opened = servers
    assert not opened.restriction_args()
    client = http.InferenceServerClient(opened.http_url)
    try:
        for call in HTTP_ADMIN:
            getattr(client, call)()
    finally:
        client.close()


def test_each_start_has_its_own_key(tmp_path):
    first, second = TritonServer(tmp_path, tmp_path), TritonServer(tmp_path, tmp_path)
    assert first.admin_key != second.admin_key and len(first.admin_key) >= 32
    assert first.admin_key not in repr(first)
