"""The Videos routes through the official `openai` client against the stand-in Triton of
tests/shared/images_stub_triton.py (a video entry "wan-tiny" serving 32x32 at 5 and 17 frames, 48x32 at 5):
create -> poll -> download gives the .mp4 whose frames are those `generate --url` gets for the same request; the
seconds -> frames rule; image-to-video with input_reference; delete stops the running clip; bad input is one clear
error each; `progress` follows the steps the entry's stream model reports (0 -> 100 without one), written at most
once per step and per interval."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from trt_diffusion.triton.client import ImageRequest, generate_images
from trt_diffusion.video_files import read_video, save_video

GUARD_S = 60


def client(api):
    import openai

    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)


def finished(openai_client, video_id: str):
    end = time.monotonic() + GUARD_S
    while time.monotonic() < end:
        video = openai_client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.05)
    raise AssertionError(f"video {video_id} is still {video.status}")


def over_triton(stub, tmp_path, name: str, **fields) -> np.ndarray:
    """The clip `generate --url` gets for the request, through the .mp4 it writes."""
    clips, _ = generate_images(stub.url, ImageRequest(**fields), pipeline="wan-tiny", protocol="grpc",
                               timeout_s=60)
    return read_video(save_video(clips[0], tmp_path / f"{name}.mp4"))


def downloaded(openai_client, video_id: str, tmp_path) -> np.ndarray:
    path = tmp_path / f"{video_id}.mp4"
    path.write_bytes(openai_client.videos.download_content(video_id).content)
    return read_video(path)


def test_a_clip_equals_what_generate_gets_from_triton(api, stub, tmp_path):
    openai_client = client(api)
    video = openai_client.videos.create(model="wan-tiny", prompt="a lighthouse", seconds="1", size="32x32",
                                        extra_body={"seed": 7, "num_inference_steps": 2, "guidance_scale": 4.0})
    assert video.status == "queued" and video.size == "32x32"
    assert video.seconds == "1.0625" and video.frames == 17  # 1 s: 17 frames (1.06 s) is nearer than 5 (0.31 s)
    video = finished(openai_client, video.id)
    assert video.status == "completed" and video.progress == 100
    frames = downloaded(openai_client, video.id, tmp_path)
    expected = over_triton(stub, tmp_path, "a", prompt="a lighthouse", height=32, width=32, steps=2,
                           guidance_scale=4.0, seed=7, frames=17)
    assert frames.shape == (17, 32, 32, 3) and np.array_equal(frames, expected)
    other = over_triton(stub, tmp_path, "b", prompt="a lighthouse", height=32, width=32, steps=2,
                        guidance_scale=4.0, seed=8, frames=17)
    assert not np.array_equal(frames, other)  # another seed is another clip: the comparison can fail
    listed = openai_client.videos.list()
    assert [v.id for v in listed.data] == [video.id]


def test_image_to_video_takes_the_reference_as_the_first_frame(api, stub, tmp_path):
    from PIL import Image

    reference = np.random.default_rng(1).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(reference).save(buffer, format="PNG")
    openai_client = client(api)
    video = openai_client.videos.create(model="wan-tiny", prompt="waves", size="48x32",
                                        input_reference=("first.png", buffer.getvalue(), "image/png"),
                                        extra_body={"seed": 3, "num_inference_steps": 2})
    assert video.frames == 5  # no seconds: the shortest served at that size
    video = finished(openai_client, video.id)
    assert video.status == "completed", video.error
    expected = over_triton(stub, tmp_path, "i2v", prompt="waves", height=32, width=48, steps=2, guidance_scale=5.0,
                           seed=3, frames=5, init_image=reference)
    assert np.array_equal(downloaded(openai_client, video.id, tmp_path), expected)


def test_delete_stops_the_running_clip(api, stub):
    import threading

    import openai

    stub.gate = threading.Semaphore(0)
    openai_client = client(api)
    video = openai_client.videos.create(model="wan-tiny", prompt="slow", extra_body={"seed": 1})
    assert stub.entered.wait(GUARD_S)
    deleted = openai_client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    assert stub.cancelled.wait(GUARD_S)  # its call left Triton's queue
    with pytest.raises(openai.NotFoundError, match=f"no video '{video.id}'"):
        openai_client.videos.retrieve(video.id)
    assert openai_client.videos.list().data == []


def test_bad_video_requests_are_one_clear_error_each(api, stub):
    import openai

    openai_client = client(api)
    with pytest.raises(openai.BadRequestError, match="size 64x64 is not served by wan-tiny; served sizes: 32x32, "
                                                     "48x32"):
        openai_client.videos.create(model="wan-tiny", prompt="a", size="64x64")
    with pytest.raises(openai.NotFoundError, match="model 'sd15-tiny' is not a served video model; served: wan-tiny"):
        openai_client.videos.create(model="sd15-tiny", prompt="a")
    with pytest.raises(openai.BadRequestError, match="unknown field 'steps'"):
        openai_client.videos.create(model="wan-tiny", prompt="a", extra_body={"steps": 3})
    with pytest.raises(openai.BadRequestError, match="seconds: Input should be greater than 0"):
        openai_client.videos.create(model="wan-tiny", prompt="a", seconds="0")
    with pytest.raises(openai.BadRequestError, match="input_reference is 32x32, the clip 48x32"):
        from PIL import Image

        buffer = io.BytesIO()
        Image.new("RGB", (32, 32)).save(buffer, format="PNG")
        openai_client.videos.create(model="wan-tiny", prompt="a", size="48x32",
                                    input_reference=("a.png", buffer.getvalue(), "image/png"))
    with pytest.raises(openai.NotFoundError, match="no video 'video-nope'"):
        openai_client.videos.download_content("video-nope")
    assert stub.infers == [] and openai_client.videos.list().data == []  # nothing reached Triton or the store


def test_progress_follows_the_denoising_steps_of_the_entry_s_stream(api, stub, tmp_path, monkeypatch):
    import threading

    from trt_diffusion.openai_api import job_runner
    from trt_diffusion.triton.configs import PRIORITY_BATCH

    monkeypatch.setattr(job_runner, "PROGRESS_EVERY_S", 0.0)  # every step message written: none can be missed
    stub.step_gate = threading.Semaphore(0)  # each step message waits for the test
    openai_client = client(api)
    video = openai_client.videos.create(model="wan-tiny", prompt="a tide", seconds="1", size="32x32",
                                        extra_body={"seed": 5, "num_inference_steps": 4, "guidance_scale": 4.0})
    seen = []

    def poll(until):
        end = time.monotonic() + GUARD_S
        while time.monotonic() < end:
            card = openai_client.videos.retrieve(video.id)
            seen.append(card.progress)
            if until(card):
                return card
            time.sleep(0.02)
        raise AssertionError(f"video {video.id}: progress {seen[-1]}, status {card.status}")

    for percent in (25, 50):  # 4 steps, a message after steps 1, 2 and 3; the next is held until released
        stub.step_gate.release()
        poll(lambda card, percent=percent: card.progress == percent and card.status == "in_progress")
    stub.step_gate.release()
    card = poll(lambda card: card.status in ("completed", "failed"))
    assert card.status == "completed" and card.progress == 100, card.error
    assert seen == sorted(seen) and seen[-1] == 100  # what a poll sees never goes back
    assert stub.steps_sent == [1, 2, 3] and stub.priorities["a tide"] == PRIORITY_BATCH  # a job, through the stream
    # the streamed clip is the one `generate --url` gets from the entry's plain call
    expected = over_triton(stub, tmp_path, "s", prompt="a tide", height=32, width=32, steps=4, guidance_scale=4.0,
                           seed=5, frames=17)
    assert np.array_equal(downloaded(openai_client, video.id, tmp_path), expected)

    # an entry without its stream model (packaged --no-stream): the plain call, progress 0 -> 100 at completion
    stub.video_stream, stub.step_gate = False, None
    plain = openai_client.videos.create(model="wan-tiny", prompt="a tide", seconds="1", size="32x32",
                                        extra_body={"seed": 5, "num_inference_steps": 4, "guidance_scale": 4.0})
    plain = finished(openai_client, plain.id)
    assert plain.status == "completed" and plain.progress == 100 and stub.steps_sent == [1, 2, 3]
    assert np.array_equal(downloaded(openai_client, plain.id, tmp_path), expected)


def test_progress_is_written_at_most_once_per_step_and_per_interval(tmp_path):
    from trt_diffusion.openai_api.job_runner import VideoProgress
    from trt_diffusion.openai_api.job_store import SqliteJobStore

    store = SqliteJobStore(tmp_path / "state")
    video = store.add_video("wan-tiny", "a", {"model": "wan-tiny", "prompt": "a", "seed": 1}, "1", "32x32")
    now = [100.0]
    progress = VideoProgress(store, video["id"], every_s=2.0, clock=lambda: now[0])
    written = []
    for at, percent in ((0.5, 10), (2.0, 20), (2.5, 30), (4.0, 30), (4.1, 40), (6.5, 35), (9.0, 20), (12.0, 120)):
        now[0] = 100.0 + at
        progress(percent)
        written.append(store.video(video["id"])["progress"])
    # 10: too soon after the start; 20 at 2 s; 30 within 2 s of it, then 2 s later; 40 too soon; 35 is the newest
    # 2 s on; 20 would go back (a retried run); 120 is held at 99 (100 comes with the clip)
    assert written == [0, 20, 20, 30, 30, 35, 35, 99]
