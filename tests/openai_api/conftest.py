"""A stand-in Triton for the API's fast tests: a real gRPC server (grpcio, Triton's own service definition) that
answers the calls the API makes before inference — live, the repository index, one entry's config — and counts
every call, so a test can prove what reached Triton. ModelInfer is refused (no engine runs here)."""

from __future__ import annotations

import collections
import threading
from concurrent import futures
from dataclasses import dataclass, field

import pytest

ENTRY = "sd15-tiny"
SIZES = "64x64"
INPUTS = ("PROMPT", "NEGATIVE_PROMPT", "HEIGHT", "WIDTH", "STEPS", "GUIDANCE_SCALE", "SEED", "NUM_IMAGES",
          "WORKFLOW", "INIT_IMAGE", "MASK", "STRENGTH", "LORAS")


@dataclass
class StubTriton:
    url: str
    entry: str = ENTRY
    calls: collections.Counter = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str) -> None:
        with self.lock:
            self.calls[name] += 1


@pytest.fixture
def stub_triton():
    import grpc
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

    from trt_diffusion.triton.configs import ROLE

    stub = StubTriton("")

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request, context):
            stub.count("ServerLive")
            return service_pb2.ServerLiveResponse(live=True)

        def RepositoryIndex(self, request, context):
            stub.count("RepositoryIndex")
            return service_pb2.RepositoryIndexResponse(models=[
                service_pb2.RepositoryIndexResponse.ModelIndex(name=ENTRY, version="1", state="READY")])

        def ModelConfig(self, request, context):
            stub.count("ModelConfig")
            parameters = {ROLE: "entry", "family": "sd15", "request_sizes": SIZES, "max_images": "4",
                          "workflows": "txt2img;img2img;inpaint"}
            config = model_config_pb2.ModelConfig(
                name=request.name, input=[model_config_pb2.ModelInput(name=name) for name in INPUTS],
                parameters={k: model_config_pb2.ModelParameter(string_value=v) for k, v in parameters.items()})
            return service_pb2.ModelConfigResponse(config=config)

        def ModelInfer(self, request, context):
            stub.count("ModelInfer")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stub triton: no engine here")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub.url = f"127.0.0.1:{port}"
    try:
        yield stub
    finally:
        server.stop(grace=None)


@pytest.fixture
def stub():
    """The stand-in Triton whose images are a function of the request (tests/shared/images_stub_triton.py), for the
    tests that run the API's routes end to end (batches, videos, priority)."""
    from images_stub_triton import start_images_stub

    stub = start_images_stub()
    yield stub
    stub.stop()


@pytest.fixture
def api_settings() -> dict:
    """ApiSettings fields of `api` beyond the stub's address, port 0 and the job store's folder: a module that needs
    a key or other limits overrides this fixture."""
    return {}


@pytest.fixture
def api(stub, tmp_path, api_settings):
    """The API, with its job store in tmp_path / "state", in front of `stub`."""
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings

    with ApiServer(ApiSettings(stub.url, port=0, **{"state_dir": tmp_path / "state", **api_settings})) as server:
        yield server
