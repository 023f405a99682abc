"""Several models in one repository and one server: `package --all-models` writes an entry per model (the tiny
sd15 and the tiny sdxl), `serve --openai-port` serves both, and the OpenAI `model` field routes each request to its
model — each image equal to the same request sent straight to that model's Triton entry. The memory budget refuses
a set of models that does not fit, naming each model's share."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from trt_diffusion.errors import ServeError
from trt_diffusion.triton.client import ImageRequest, generate_images
from trt_diffusion.triton.server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.triton]

MODELS = {"sd15": "sd15", "sdxl": "sdxl"}  # name in engines.yaml -> family
PROMPT = "a red fox in the snow"
START_GUARD_S = 600  # the server's start (models load and warm): a hang guard, not a latency


@pytest.fixture(scope="module")
def two_models(tiny_model_factory, tmp_path_factory) -> Path:
    """engines.yaml with the tiny sd15 and the tiny sdxl, 64x64, fp32, their onnxruntime engines built."""
    from trt_diffusion import api
    from trt_diffusion.families import family_info

    root = tmp_path_factory.mktemp("two-models")
    models = {}
    for name, family in MODELS.items():
        components = [c.value for c in family_info(family).components]
        models[name] = {"source": str(tiny_model_factory(family)), "family": family, "buckets": ["64x64"],
                        "batch": [1], "targets": ["onnxruntime"], "precision": {c: "fp32" for c in components}}
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(root / "build")}, "models": models},
                                   sort_keys=False))
    report = api.build(path, target="onnxruntime")
    assert not report.failed, [o.error for o in report.failed]
    return path


def test_the_budget_refuses_models_that_do_not_fit_naming_each_share(two_models, tmp_path):
    from trt_diffusion import api

    with pytest.raises(ServeError) as caught:
        api.package(two_models, tmp_path / "repo", all_models=True, memory_budget_gb=0.5)
    message = str(caught.value)
    assert "above the 0.5 GB memory budget (--memory-budget-gb)" in message
    assert "sd15 " in message and "sdxl " in message and "python processes" in message
    assert not (tmp_path / "repo").exists()  # nothing half-written
    with pytest.raises(ServeError, match="has no model 'sd3'; its models: sd15, sdxl"):
        api.package(two_models, tmp_path / "repo", model=["sd15", "sd3"])
    with pytest.raises(ServeError, match=r"has 2 models \(sd15, sdxl\); choose with --model \(repeatable\) or "
                                         "--all-models"):
        api.package(two_models, tmp_path / "repo")


def read_until(process: subprocess.Popen, marker: str) -> str:
    """The server's stdout up to the line with `marker` (it prints the OpenAI URL once everything is ready)."""
    seen = []
    deadline = time.monotonic() + START_GUARD_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"serve exited ({process.poll()}) before '{marker}':\n{''.join(seen)}")
        seen.append(line)
        if marker in line:
            return line
    pytest.fail(f"no '{marker}' within {START_GUARD_S} s:\n{''.join(seen)}")


def test_one_server_serves_both_models_routed_by_name(two_models, tmp_path):
    import openai
    from PIL import Image

    from trt_diffusion import api

    report = api.package(two_models, tmp_path / "repo", all_models=True)
    assert [p.entry for p in report.all_pipelines()] == ["sd15", "sdxl"]
    assert [p.family for p in report.all_pipelines()] == ["sd15", "sdxl"]
    assert [m["model"] for m in report.memory] == ["sd15", "sdxl"]
    http, grpc, metrics, api_port = (free_port() for _ in range(4))
    process = subprocess.Popen(
        [sys.executable, "-m", "trt_diffusion", "serve", "--repo", str(tmp_path / "repo"), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(api_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        line = read_until(process, "OpenAI")
        assert f"http://127.0.0.1:{api_port}/v1" in line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == ["sd15", "sdxl"]
        images = {}
        for name in MODELS:
            result = client.images.generate(model=name, prompt=PROMPT, size="64x64",
                                            extra_body={"seed": 9, "num_inference_steps": 3})
            with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as image:
                images[name] = np.asarray(image.convert("RGB"))
            expected, _ = generate_images(f"127.0.0.1:{grpc}", ImageRequest(PROMPT, 64, 64, steps=3, seed=9),
                                          pipeline=name, protocol="grpc", timeout_s=120)
            assert np.array_equal(images[name], expected[0]), name
        assert not np.array_equal(images["sd15"], images["sdxl"])  # two models, two images: routing can fail
        with pytest.raises(openai.BadRequestError, match="model is required: this server serves 2 models"):
            client.images.generate(prompt=PROMPT)
        with pytest.raises(openai.NotFoundError, match="model 'sd3' is not served; served: sd15, sdxl"):
            client.images.generate(model="sd3", prompt=PROMPT)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0
