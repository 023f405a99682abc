"""Videos as files: .mp4 (H.264 yuv420p) and .gif written atomically and read back, refusals that name the file,
and where a generation's videos go."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion.errors import ConfigError
from trt_diffusion.metrics import psnr
from trt_diffusion.video_files import DEFAULT_FPS, read_video, save_video, save_videos, video_output


def _clip(frames: int = 9, height: int = 32, width: int = 48) -> np.ndarray:
    """A smooth gradient drifting a few levels a frame (what a codec keeps well)."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([np.stack([(x * 4 + t * 6) % 256, y * 6, (x + y + t * 3) % 256], axis=-1)
                     for t in range(frames)]).astype(np.uint8)


def test_mp4_round_trip_is_h264_yuv420p_at_the_given_rate(tmp_path):
    import av

    clip = _clip()
    path = save_video(clip, tmp_path / "a.mp4", fps=24)
    back = read_video(path)
    assert back.shape == clip.shape and back.dtype == np.uint8
    assert psnr(clip, back) > 30  # lossy, but close
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert stream.average_rate == 24
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary name


def test_default_rate_is_wans(tmp_path):
    import av

    assert DEFAULT_FPS == 16
    with av.open(str(save_video(_clip(), tmp_path / "a.mp4"))) as container:
        assert container.streams.video[0].average_rate == 16


def test_gif_round_trip_keeps_repeated_frames(tmp_path):
    from PIL import Image

    clip = _clip()
    clip[3] = clip[4] = clip[2]  # Pillow merges these three into one GIF frame; read_video expands them again
    path = save_video(clip, tmp_path / "a.gif")
    back = read_video(path)
    assert back.shape == clip.shape
    assert psnr(clip, back) > 25  # a 256-colour palette per frame
    np.testing.assert_array_equal(back[3], back[2])
    with Image.open(path) as image:
        assert image.info["loop"] == 0  # loops forever


def test_odd_sizes_are_refused_for_mp4_and_fine_for_gif(tmp_path):
    odd = _clip(height=31, width=48)
    with pytest.raises(ConfigError, match=r"odd\.mp4: H\.264 .* even width and height; these frames are 48x31"):
        save_video(odd, tmp_path / "odd.mp4")
    assert read_video(save_video(odd, tmp_path / "odd.gif")).shape == odd.shape
    assert not (tmp_path / "odd.mp4").exists()


def test_an_existing_file_is_never_replaced_silently(tmp_path):
    path = save_video(_clip(), tmp_path / "a.mp4")
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=r"a\.mp4 exists"):
        save_video(_clip(frames=3), path)
    assert path.read_bytes() == before
    save_video(_clip(frames=3), path, overwrite=True)
    assert len(read_video(path)) == 3


def test_unsupported_suffixes_name_the_supported_ones(tmp_path):
    for name in ("a.webm", "a"):
        with pytest.raises(ConfigError, match=rf"{name}: a video file is \.mp4 or \.gif, not"):
            save_video(_clip(), tmp_path / name)
    with pytest.raises(ConfigError, match=r"a\.avi: a video file is \.mp4 or \.gif, not \.avi"):
        read_video(tmp_path / "a.avi")


def test_bad_frames_and_rates(tmp_path):
    with pytest.raises(ValueError, match=r"uint8 \[frames, height, width, 3\].*float32 \[2, 8, 8, 3\]"):
        save_video(np.zeros((2, 8, 8, 3), np.float32), tmp_path / "a.mp4")
    with pytest.raises(ValueError, match=r"\[8, 8, 3\]"):
        save_video(np.zeros((8, 8, 3), np.uint8), tmp_path / "a.gif")
    for fps in (0, -1, float("nan"), "16"):
        with pytest.raises(ConfigError, match="fps"):
            save_video(_clip(), tmp_path / "a.mp4", fps=fps)
    with pytest.raises(ConfigError, match=r"a\.gif: a GIF plays at most 50 frames per second"):
        save_video(_clip(), tmp_path / "a.gif", fps=60)
    assert list(tmp_path.iterdir()) == []


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.mp4: no such file"):
        read_video(tmp_path / "missing.mp4")
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    with pytest.raises(ConfigError, match=r"junk\.mp4: not a readable \.mp4 video"):
        read_video(tmp_path / "junk.mp4")


def test_video_output_names():
    assert video_output("out.png").name == "out.mp4"  # generate's default output is an image name
    assert video_output("clip").name == "clip.mp4"
    assert video_output("clip.GIF").name == "clip.GIF" and video_output("a/b.mp4").as_posix() == "a/b.mp4"
    with pytest.raises(ConfigError, match=r"clip\.webm: a video file is \.mp4 or \.gif"):
        video_output("clip.webm")


def test_save_videos_names_several_and_never_reuses_a_name(tmp_path):
    videos = np.stack([_clip(frames=3), _clip(frames=3)[:, ::-1]])
    first = save_videos(videos, tmp_path / "out.png", fps=8)
    assert [p.name for p in first] == ["out-0.mp4", "out-1.mp4"]
    np.testing.assert_array_equal(read_video(first[1]).shape, videos[1].shape)
    again = save_videos(videos, tmp_path / "out.png")
    assert [p.name for p in again] == ["out-0001.mp4", "out-0002.mp4"]
    assert [p.name for p in save_videos(videos[:1], tmp_path / "one.gif")] == ["one.gif"]
    with pytest.raises(ValueError, match=r"\[count, frames, height, width, 3\]"):
        save_videos(videos[0], tmp_path / "x.mp4")


@pytest.fixture
def generated_videos(monkeypatch):
    """`generate` answered with two synthetic videos [2, F, H, W, 3], as a video model's pipeline answers."""
    from trt_diffusion import api

    videos = np.stack([_clip(frames=5), _clip(frames=5)[:, :, ::-1]])
    monkeypatch.setattr(api, "generate", lambda request, **options: (videos, {}, "wan-tiny"))
    return videos


def _generate(tmp_path, *options):
    from trt_diffusion.cli import main

    return main(["generate", "--prompt", "a boat", "--config", str(tmp_path / "engines.yaml"), "--height", "32",
                 "--width", "48", *options])


def test_generate_writes_a_video_models_output_as_mp4(generated_videos, tmp_path, capsys):
    assert _generate(tmp_path, "-o", str(tmp_path / "out.png"), "--num-images", "2", "--fps", "8") == 0
    assert "5 frames at 8 fps" in capsys.readouterr().out
    for i in range(2):
        assert read_video(tmp_path / f"out-{i}.mp4").shape == generated_videos[i].shape
    assert not list(tmp_path.glob("*.png"))


def test_generate_writes_gif_when_asked_and_refuses_other_suffixes(generated_videos, tmp_path, capsys):
    assert _generate(tmp_path, "-o", str(tmp_path / "clip.gif"), "--num-images", "2") == 0
    assert [len(read_video(tmp_path / f"clip-{i}.gif")) for i in range(2)] == [5, 5]
    capsys.readouterr()
    assert _generate(tmp_path, "-o", str(tmp_path / "clip.webm"), "--num-images", "2") == 1
    err = capsys.readouterr().err
    assert "clip.webm: a video file is .mp4 or .gif, not .webm" in " ".join(err.split()) and "Traceback" not in err
