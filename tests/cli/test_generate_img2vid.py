"""`trt-diffusion generate --config --image --frames` on a built Wan image-to-video model, in process (issue 24):
the PNG is the clip's first frame, the .mp4 written is what PyAV, an independent decoder, reads back as the
request's frames at the image's size; an image of another size than the built bucket is one message (exit 1)
naming both sizes. Served, the same command is tested in tests/triton/test_wan_i2v_serving.py. Slow: it builds
the tiny Wan 2.1 I2V engines (about a minute on 2 cores)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from trt_diffusion.cli import main
from trt_diffusion.sample_inputs import init_image

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SIZE, FRAMES = 32, 5  # built_wan_i2v's i2v bucket


def _frames(path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])


def test_generate_image_in_process_writes_the_clip(built_wan_i2v, tmp_path, capsys):
    config = built_wan_i2v("i2v")
    Image.fromarray(init_image(SIZE, SIZE, seed=5)).save(tmp_path / "first.png")
    args = ["generate", "--config", str(config), "--prompt", "a red fox running through snow", "--steps", "3",
            "--guidance-scale", "5", "--image", str(tmp_path / "first.png"), "--frames", str(FRAMES)]
    assert main([*args, "-o", str(tmp_path / "fox.png")]) == 0, capsys.readouterr().err
    out = " ".join(capsys.readouterr().out.split())
    assert f"fox.mp4 ({SIZE}x{SIZE}, {FRAMES} frames at 16 fps" in out  # a video model's OUTPUT.png is OUTPUT.mp4
    clip = _frames(tmp_path / "fox.mp4")
    assert clip.shape == (FRAMES, SIZE, SIZE, 3)
    assert main([*args, "--seed", "1", "-o", str(tmp_path / "other.mp4")]) == 0
    assert not np.array_equal(clip, _frames(tmp_path / "other.mp4"))  # the seed's own clip, not a fixed one


def test_an_image_of_another_size_is_one_message(built_wan_i2v, tmp_path, capsys):
    config = built_wan_i2v("i2v")
    Image.fromarray(init_image(SIZE, 48)).save(tmp_path / "wide.png")
    code = main(["generate", "--config", str(config), "--prompt", "a fox", "--image", str(tmp_path / "wide.png"),
                 "--frames", str(FRAMES), "-o", str(tmp_path / "wide.mp4")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and "Traceback" not in err and not (tmp_path / "wide.mp4").exists()
    assert ("size 48x32x5 is not served; supported sizes: 32x32x5; --image " in err
            and "wide.png is 48x32 and sets the request's size (images are not resized): resize it to a served "
                "width x height" in err), err
