"""Generated videos as files: uint8 [F, H, W, 3] frames to .mp4 or .gif and back, and where a generation's videos go.

.mp4 is H.264 in yuv420p (High profile, CRF 18), the one combination every browser, phone and editor plays; it is
encoded with PyAV, whose wheel bundles FFmpeg and libx264. yuv420p stores colour at half resolution, so H.264 needs
an even width and height: odd sizes are refused with the reason (never padded: a file whose size differs from its
frames would surprise whoever reads it back). .gif (Pillow, looped forever) has a 256-colour palette per frame and
10 ms timing steps: a preview format, not a lossless one.

Both are encoded in memory and written under a temporary name beside the file, then renamed (no half-written
file; so the .mp4's index sits at its end, as in any file FFmpeg writes without a second `faststart` pass); an
existing file is never replaced unless `overwrite` says so. Names for several videos come from
`image_files.output_paths` (taken names are never reused).
"""

from __future__ import annotations

import io
import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:  # numpy, PyAV and Pillow load when a video is written or read, not with the CLI
    import numpy as np

DEFAULT_FPS = 16  # Wan 2.x generates 16 frames per second
MP4_CRF = 18  # x264's "visually lossless": a generated clip is the product, not a preview
MAX_GIF_FPS = 50  # GIF delays are 10 ms steps, and browsers play delays under 20 ms as 100 ms
# Pillow merges identical consecutive GIF frames (summing their delays); the fps in the GIF's comment lets
# read_video expand them back to the frames that were written.
_GIF_COMMENT = "trt_diffusion fps={fps}"
_GIF_FPS = re.compile(rb"trt_diffusion fps=([0-9.]+)")


def _check_frames(frames) -> np.ndarray:
    import numpy as np

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
        raise ValueError(f"a video is uint8 [frames, height, width, 3] with at least one frame, got "
                         f"{frames.dtype} {list(frames.shape)}")
    return frames


def _check_fps(fps: float, where: Path) -> Fraction:
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
        raise ConfigError(f"{where}: fps {fps!r}; a video's frame rate is a positive number of frames per second")
    return Fraction(fps).limit_denominator(1001)  # FFmpeg takes a rational rate


def _mp4_bytes(frames: np.ndarray, fps: Fraction, where: str) -> bytes:
    import av

    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ConfigError(f"{where}: H.264 in yuv420p (what every player plays) needs an even width and height; "
                          f"these frames are {width}x{height}: generate an even size, or write a .gif")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": str(MP4_CRF)})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())  # flush the frames the encoder holds back
    return buffer.getvalue()


def _gif_bytes(frames: np.ndarray, fps: Fraction, where: str) -> bytes:
    from PIL import Image

    if fps > MAX_GIF_FPS:
        raise ConfigError(f"{where}: a GIF plays at most {MAX_GIF_FPS} frames per second (its delays are 10 ms "
                          f"steps), not {float(fps):g}; write an .mp4 or lower the fps")
    images = [Image.fromarray(pixels) for pixels in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], loop=0,
                   duration=1000 / float(fps), comment=_GIF_COMMENT.format(fps=float(fps)).encode())
    return buffer.getvalue()


_ENCODERS: dict[str, Callable[[np.ndarray, Fraction, str], bytes]] = {".mp4": _mp4_bytes, ".gif": _gif_bytes}
VIDEO_SUFFIXES = tuple(_ENCODERS)


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _ENCODERS:
        raise ConfigError(f"{path}: a video file is {' or '.join(VIDEO_SUFFIXES)}, not "
                          f"{suffix or 'a name without a suffix'}")
    return suffix


def save_video(frames, path: str | Path, fps: float = DEFAULT_FPS, *, overwrite: bool = False) -> Path:
    """Write uint8 [F, H, W, 3] frames as `path` (.mp4: H.264 yuv420p; .gif: looped), atomically. An existing
    `path` is an error unless `overwrite`."""
    from .workspace.files import atomic_write_bytes

    path = Path(path)
    encoder = _ENCODERS[_suffix(path)]
    frames, rate = _check_frames(frames), _check_fps(fps, path)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; choose another name or overwrite it (generate --overwrite)")
    atomic_write_bytes(path, encoder(frames, rate, str(path)))
    return path


def read_video(path: str | Path) -> np.ndarray:
    """The frames of an .mp4 or .gif as uint8 [F, H, W, 3] (RGB)."""
    import numpy as np

    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        frames = _read_gif(path) if suffix == ".gif" else _read_mp4(path)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - PyAV and Pillow raise their own kinds for a corrupt or foreign file
        raise ConfigError(f"{path}: not a readable {suffix} video ({exc})") from None
    if not frames:
        raise ConfigError(f"{path}: holds no video frames")
    return np.stack(frames)


def _read_mp4(path: Path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ConfigError(f"{path}: holds no video stream")
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(container.streams.video[0])]


def _read_gif(path: Path) -> list[np.ndarray]:
    import numpy as np
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        written = _GIF_FPS.search(image.info.get("comment", b""))
        frame_ms = 1000 / float(written.group(1)) if written else None
        frames = []
        for frame in ImageSequence.Iterator(image):
            pixels = np.asarray(frame.convert("RGB"), dtype=np.uint8)
            # a frame Pillow merged with its repeats carries their summed delay (truncated to 10 ms)
            repeats = max(1, round(frame.info.get("duration", 0) / frame_ms)) if frame_ms else 1
            frames += [pixels] * repeats
        return frames


def video_output(output: str | Path) -> Path:
    """Where a generation's video goes, from generate's OUTPUT: .mp4 and .gif as given; an image name (.png,
    generate's default) or no suffix becomes .mp4; any other suffix is an error naming the supported ones."""
    output = Path(output)
    if output.suffix.lower() in ("", ".png"):
        return output.with_suffix(".mp4")
    _suffix(output)
    return output


def save_videos(videos, output: str | Path, fps: float = DEFAULT_FPS, *, overwrite: bool = False) -> list[Path]:
    """Write a generation's uint8 [N, F, H, W, 3] videos: one as OUTPUT (see `video_output`), several as
    OUTPUT-0.mp4, OUTPUT-1.mp4, …; names already taken are never reused unless `overwrite` (`output_paths`)."""
    import numpy as np

    from .image_files import output_paths

    videos = np.asarray(videos)
    if videos.ndim != 5:
        raise ValueError(f"videos are uint8 [count, frames, height, width, 3], got {videos.dtype} "
                         f"{list(videos.shape)}")
    paths = output_paths(video_output(output), len(videos), overwrite=overwrite)
    return [save_video(frames, path, fps, overwrite=overwrite) for frames, path in zip(videos, paths)]
