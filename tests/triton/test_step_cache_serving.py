"""STEP_CACHE served: the entry reads it (on/off, absent: engines.yaml's default), pipeline.json carries the step
cache and the pieces are engine models of their own; served (slow), a cached request equals the in-process cached
pipeline, STEP_CACHE=off the uncached one, and a bad value is a 400 naming it while the server stays up."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.triton.backend import pb, requests
from trt_diffusion.triton.client import ImageRequest
from trt_diffusion.triton.description import PipelineDescription

PROMPT = "a lighthouse on a cliff at dusk"


def image_request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=64, width=64, steps=5, guidance_scale=5.0, seed=4)
    return ImageRequest(**{**values, **change})


def test_the_backend_reads_step_cache_as_sent(monkeypatch):
    monkeypatch.setattr(pb, "input_array", lambda tensors, name: tensors.get(name))
    assert requests.read_request(image_request(step_cache="off").tensors()).step_cache == "off"
    assert requests.read_request(image_request().tensors()).step_cache is None  # engines.yaml's default


@pytest.fixture(scope="module")
def cached_model(built_sd15_step_cache):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners

    config = load_engines_file(built_sd15_step_cache, check_sources=True)
    model_dir, family, table = engine_runners(config, "sd15-tiny", "onnxruntime")
    return SimpleNamespace(model_dir=model_dir, family=family, table=table,
                           step_cache=config.models["sd15-tiny"].step_cache)


@pytest.fixture(scope="module")
def server(built_sd15_step_cache, tmp_path_factory):
    from trt_diffusion.triton import stage

    root = tmp_path_factory.mktemp("step-cache-repo")
    stage.package_stage(built_sd15_step_cache, root / "repo")
    served, warm = stage.start(root / "repo", work_dir=root / "work", first_request=True)
    try:
        yield SimpleNamespace(server=served, warmup=warm, repo=root / "repo")
    finally:
        served.stop()


def local(model, request: ImageRequest, step_cache: str | None) -> np.ndarray:
    pipeline = EnginePipeline(model.model_dir, model.family, model.table, step_cache=model.step_cache)
    return pipeline.generate(GenerationRequest(
        prompt=request.prompt, height=request.height, width=request.width, steps=request.steps,
        guidance_scale=request.guidance_scale, seed=request.seed, step_cache=step_cache)).images[0]


def served_image(server, request: ImageRequest, protocol: str = "grpc") -> np.ndarray:
    from trt_diffusion.triton import client as triton_client

    url = server.server.http_url if protocol == "http" else server.server.grpc_url
    return triton_client.generate_images(url, request, protocol=protocol)[0][0]


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_served_step_cache_equals_the_in_process_pipeline(server, cached_model):
    description = PipelineDescription.read(server.repo / "sd15-tiny" / "1")
    assert description.step_cache_object == cached_model.step_cache
    assert {"unet", "unet_deep", "unet_shallow"} <= {e.component for e in description.engines}
    cached = local(cached_model, image_request(), "on")
    uncached = local(cached_model, image_request(), "off")
    assert not np.array_equal(cached, uncached)
    np.testing.assert_array_equal(served_image(server, image_request()), cached)  # absent: engines.yaml's on
    np.testing.assert_array_equal(served_image(server, image_request(step_cache="on"), "http"), cached)
    np.testing.assert_array_equal(served_image(server, image_request(step_cache="off")), uncached)


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_a_bad_step_cache_is_refused_by_name_and_the_server_stays_up(server, cached_model):
    with pytest.raises(ServeError, match="STEP_CACHE must be 'on' or 'off', got 'maybe'") as caught:
        served_image(server, image_request(step_cache="maybe"))
    assert type(caught.value) is ServeError
    np.testing.assert_array_equal(served_image(server, image_request(step_cache="off")),
                                  local(cached_model, image_request(), "off"))
