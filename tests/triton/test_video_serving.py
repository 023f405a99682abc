"""Wan video on the real tritonserver (issue 24): the entry answers VIDEO [N, F, H, W, 3] equal, bit for bit, to
the in-process EnginePipeline over the same engines, over HTTP and gRPC (NUM_IMAGES videos, seeds SEED, SEED+1);
the stream previews each latent frame; `generate` writes an .mp4 that PyAV's decoder reads back as F frames of
the request's size; bad requests (frames not 4k+1, a frame count not built, no frames, FRAMES to an image model)
are refused in the project's words and leave the server healthy; the OpenAI API's video job runs through the
stream, its progress following the steps.

The engines: tiny Wan 2.1 at 32x32x5, cfg split (batch-1 transformer calls, as WanPipeline runs them), onnxruntime:
about 40 s to export and build, so `slow`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton.client import ImageRequest

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "a red fox running through snow"
SIZE, FRAMES = 32, 5  # the bucket tests/conftest.py's built_wan builds


@pytest.fixture(scope="module")
def wan_workspace(built_wan) -> Path:
    return built_wan("split")


@pytest.fixture(scope="module")
def local_pipeline(wan_workspace):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline

    config = load_engines_file(wan_workspace, check_sources=True)
    model_dir, family, table = engine_runners(config, "wan", "onnxruntime")
    return EnginePipeline(model_dir, family, table)


@pytest.fixture(scope="module")
def server(wan_workspace, tmp_path_factory):
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions

    root = tmp_path_factory.mktemp("wan-repo")
    report = stage.package_stage(wan_workspace, root / "repo", options=PackageOptions(ensemble=True))
    assert report.ensemble is None  # video: the entry and the stream only
    served, _ = stage.start(root / "repo", work_dir=root / "work", first_request=True)
    try:
        yield served
    finally:
        served.stop()


def video_request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=SIZE, width=SIZE, steps=3, guidance_scale=5.0, seed=7, frames=FRAMES)
    values.update(change)
    return ImageRequest(**values)


def local(pipeline, request: ImageRequest, seed_offset: int = 0) -> np.ndarray:
    from trt_diffusion.runtime.pipeline import GenerationRequest

    return pipeline.generate(GenerationRequest(
        prompt=request.prompt, height=request.height, width=request.width, steps=request.steps,
        guidance_scale=request.guidance_scale, seed=request.seed + seed_offset, frames=request.frames)).images[0]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_videos_equal_the_in_process_pipeline(server, local_pipeline, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    videos, parameters = triton_client.generate_images(url, video_request(num_images=2), protocol=protocol)
    assert videos.shape == (2, FRAMES, SIZE, SIZE, 3) and videos.dtype == np.uint8
    for k in range(2):  # NUM_IMAGES videos: seeds SEED, SEED + 1
        np.testing.assert_array_equal(videos[k], local(local_pipeline, video_request(), k))
    assert parameters["timing"]["steps_s"]


def test_the_stream_previews_each_latent_frame(server, local_pipeline):
    video, previews, _ = triton_client.stream(server.grpc_url, video_request(), model="wan_stream", preview_every=1)
    np.testing.assert_array_equal(video, local(local_pipeline, video_request()))
    latent_frames = (FRAMES - 1) // 4 + 1
    assert [step for step, _ in previews] == [1, 2]
    assert all(p.shape == (latent_frames, SIZE // 8, SIZE // 8, 3) for _, p in previews)


def test_generate_writes_an_mp4_an_independent_decoder_reads_back(server, local_pipeline, tmp_path):
    import av

    from trt_diffusion.cli import main

    out = tmp_path / "fox.mp4"
    code = main(["generate", "--url", server.http_url, "--prompt", PROMPT, "--steps", "3", "--guidance-scale", "5",
                 "--seed", "7", "--frames", str(FRAMES), "-o", str(out)])
    assert code == 0
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert len(frames) == FRAMES and all(f.shape == (SIZE, SIZE, 3) for f in frames)
    decoded = np.stack(frames).astype(int)
    # H.264 is lossy (and a 32x32 clip of a random model is all detail): the file holds this request's video when
    # it is much closer to it than to the next seed's
    error = np.abs(decoded - local(local_pipeline, video_request()).astype(int)).mean()
    assert error < 0.5 * np.abs(decoded - local(local_pipeline, video_request(), 1).astype(int)).mean()


@pytest.mark.parametrize("change, message", [
    ({"frames": 6}, r"FRAMES must be 4k\+1"),
    ({"frames": 9}, "size 32x32x9 is not served; supported sizes: 32x32x5"),
    ({"frames": None}, "serves video: send FRAMES"),
])
def test_bad_video_requests_are_refused_and_the_server_stays_up(server, change, message):
    with pytest.raises(ServeError, match=message):
        triton_client.generate_images(server.grpc_url, video_request(**change), protocol="grpc")
    assert triton_client.generate_images(server.grpc_url, video_request(), protocol="grpc")[0].shape[1] == FRAMES


def test_a_video_job_s_progress_follows_the_stream_s_steps(server, local_pipeline, tmp_path, monkeypatch):
    """The OpenAI API's video job asks the entry's stream (the python backend's STEP messages reach it) and ends with
    the entry's clip; its progress takes each step's value, never going back."""
    import time

    import openai

    from trt_diffusion.openai_api import job_runner
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings
    from trt_diffusion.video_files import read_video, save_video

    reported = []
    report = job_runner.VideoProgress.__call__

    def recording(self, percent):
        reported.append(percent)
        report(self, percent)

    monkeypatch.setattr(job_runner.VideoProgress, "__call__", recording)
    monkeypatch.setattr(job_runner, "PROGRESS_EVERY_S", 0.0)
    with ApiServer(ApiSettings(server.grpc_url, port=0, state_dir=tmp_path / "state")) as api:
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)
        video = client.videos.create(model="wan", prompt=PROMPT, size=f"{SIZE}x{SIZE}",
                                     extra_body={"seed": 7, "num_inference_steps": 3, "guidance_scale": 5.0})
        seen, end = [], time.monotonic() + 300
        while video.status not in ("completed", "failed") and time.monotonic() < end:
            video = client.videos.retrieve(video.id)
            seen.append(video.progress)
            time.sleep(0.05)
        assert video.status == "completed" and video.progress == 100, video.error
        (tmp_path / "job.mp4").write_bytes(client.videos.download_content(video.id).content)
    assert reported == [33, 66]  # 3 steps: a STEP message after steps 1 and 2 (PREVIEW_EVERY 1)
    assert seen == sorted(seen)
    expected = read_video(save_video(local(local_pipeline, video_request()), tmp_path / "local.mp4"))
    assert np.array_equal(read_video(tmp_path / "job.mp4"), expected)  # the same clip, encoded the same way
