"""Live previews over gRPC (issue 18): the streaming entry `<pipeline>_stream` sends a preview every K steps
(latents mapped linearly to RGB, no VAE call), then the image, equal to the non-streamed image; a cancelled
stream stops at the next step and frees the instance; PREVIEW_EVERY 0 is a clear error."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton.backend.previews import latent_rgb_map, preview
from trt_diffusion.triton.client import ImageRequest, RequestCancelled

pytestmark = [pytest.mark.triton, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(sd15_engines, tmp_path_factory):
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions, package

    root = tmp_path_factory.mktemp("triton-previews")
    report = package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name,
                     root / "repo", PackageOptions(ensemble=False, pipeline_instances=1))
    server, _ = stage.start(root / "repo", work_dir=root / "work", first_request=False)
    try:
        yield server, report
    finally:
        server.stop()


def stream_model(report) -> str:
    return f"{report.entry}_stream"


def test_stream_sends_previews_then_the_same_image(served):
    server, report = served
    request = ImageRequest("a lighthouse at dusk", 64, 64, steps=7, seed=4)
    image, previews, parameters = triton_client.stream(server.grpc_url, request, model=stream_model(report),
                                                       preview_every=2)
    assert [step for step, _ in previews] == [2, 4, 6]
    assert all(p.shape == (8, 8, 3) and p.dtype == np.uint8 for _, p in previews)
    assert not np.array_equal(previews[0][1], previews[-1][1])  # they change as the image forms
    plain, _ = triton_client.generate_images(server.grpc_url, request, pipeline=report.entry, protocol="grpc")
    np.testing.assert_array_equal(image, plain[0])
    assert len(parameters["timing"]["steps_s"][0]) == 7


def test_cancelled_stream_frees_the_instance_within_a_step(served):
    server, report = served
    long = ImageRequest("a lighthouse at dusk", 64, 64, steps=1000, seed=4)
    with pytest.raises(RequestCancelled):
        triton_client.stream(server.grpc_url, long, model=stream_model(report), preview_every=1,
                             on_preview=lambda step, _: step < 3)
    # One instance: the next stream is served only once the cancelled one has stopped (within one step; the
    # 1000-step request would otherwise hold it for many seconds: the log line says when it stopped).
    image, _, _ = triton_client.stream(server.grpc_url, ImageRequest("a fox", 64, 64, steps=2, seed=1),
                                       model=stream_model(report), preview_every=1)
    assert image.shape == (64, 64, 3)
    deadline = time.monotonic() + 60
    while "stream cancelled after" not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the cancelled stream was not stopped"
        time.sleep(0.1)


def test_preview_interval_zero_is_a_clear_error(served):
    server, report = served
    with pytest.raises(ServeError, match="PREVIEW_EVERY must be at least 1"):
        triton_client.stream(server.grpc_url, ImageRequest("a fox", 64, 64, steps=2), model=stream_model(report),
                             preview_every=0)
    image, _, _ = triton_client.stream(server.grpc_url, ImageRequest("a fox", 64, 64, steps=2),
                                       model=stream_model(report))
    assert image.shape == (64, 64, 3)


def test_latent_rgb_maps():
    weights, bias = latent_rgb_map("sd15", 4)
    assert weights.shape == (4, 3) and bias.shape == (3,)
    assert latent_rgb_map("sd3", 16)[0].shape == (16, 3)  # the plain fallback
    latents = np.zeros((4, 8, 8), np.float32)
    assert (preview(latents, "sd15", 64, 64) == 128).all()  # zero latents: mid grey
    packed = np.zeros((16, 64), np.float32)  # FLUX: (8/2)*(8/2) tokens of 16 channels x 2 x 2
    assert preview(packed, "flux", 64, 64).shape == (8, 8, 3)
