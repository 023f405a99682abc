"""`serve --no-triton-http --openai-port` end to end (issue 44, finding 6): tritonserver on the tiny sd15 repository
with no HTTP and no metrics port, ready and warmed over gRPC, the guarded API in front of it, and an image through
the real openai client equal to the same request sent straight to Triton's gRPC port."""

from __future__ import annotations

import base64
import io
import socket

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.triton]

PROMPT = "a lighthouse"


def test_a_grpc_only_triton_serves_the_api(built_sd15, tmp_path):
    import openai
    from PIL import Image

    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.client import ImageRequest, generate_images
    from trt_diffusion.triton.repository import PackageOptions, package

    config = load_engines_file(built_sd15, check_sources=True)
    (name,) = config.models
    model = config.models[name]
    report = package(built_engines(config, name, "onnxruntime"), model.source.path, model.family, name,
                     tmp_path / "repo", PackageOptions(ensemble=False, stream=False))
    server, warmup = stage.start(tmp_path / "repo", work_dir=tmp_path / "work", triton_http=False)
    try:
        assert warmup.all_ready and warmup.http_url == "" and [r.protocol for r in warmup.first_requests] == ["grpc"]
        for port in (server.ports.http, server.ports.metrics):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
        with ApiServer(ApiSettings(server.grpc_url, port=0)) as api:
            client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)
            result = client.images.generate(model=report.entry, prompt=PROMPT, response_format="b64_json",
                                            extra_body={"seed": 3, "num_inference_steps": 2})
        with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as image:
            served = np.asarray(image.convert("RGB"))
        direct, _ = generate_images(server.grpc_url, ImageRequest(PROMPT, 64, 64, steps=2, seed=3),
                                    pipeline=report.entry, protocol="grpc", timeout_s=120)
        assert np.array_equal(served, direct[0])
    finally:
        server.stop()
