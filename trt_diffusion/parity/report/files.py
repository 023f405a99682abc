"""The report's files: PNGs, |diff| heatmaps, JSON + JSON Schema and the HTML page, each written atomically.
A clip [F, H, W, 3] is written as a frame strip PNG (every k-th frame side by side, under its .png name; its heatmap
is the strips') and a looped animated WebP preview beside it."""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from ...video_files import DEFAULT_FPS
from ...workspace.files import atomic_write_bytes
from .heatmap import diff_heatmap, diff_png_name
from .html_page import render_html
from .model import ImageComparison, ParityReport, relative_png_name

STRIP_FRAMES = 8  # a strip shows at most this many frames of a clip: every ceil(F / 8)-th
STRIP_GAP = 2  # white pixels between a strip's frames
# Previews are lossy WebP, in true colour: a synthetic Wan-sized clip (81 frames of 832x480) took ~1 MB and ~2 s,
# as a GIF ~10 MB and ~20 s. The strips and heatmaps keep the exact pixels.
PREVIEW_QUALITY = 90

REPORT_JSON = "parity.json"
REPORT_SCHEMA = "parity.schema.json"
REPORT_HTML = "parity.html"


def _write_atomically(path: Path, data: bytes) -> Path:
    atomic_write_bytes(path, data)  # temporary name beside it, fsync, rename: readers never see half a file
    return path


def _png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    pixels = np.asarray(image)
    if pixels.dtype != np.uint8:
        raise ValueError(f"images are written as 8-bit PNG: expected uint8 pixels, got {pixels.dtype}")
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    if not (pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[-1] in (3, 4))):
        raise ValueError(f"expected an HxW, HxWx3 or HxWx4 image, got shape {pixels.shape}")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _referenced_pngs(report: ParityReport) -> list[str]:
    names = []
    for variant in report.variants:
        for image in variant.images:
            names += [image.reference_png, image.candidate_png]
            names += [name for name in (image.init_png, image.mask_png) if name]
    return list(dict.fromkeys(names))


def _check_images_given(report: ParityReport, images: Mapping[str, np.ndarray]) -> None:
    for name in images:
        relative_png_name(name)
    missing = [name for name in _referenced_pngs(report) if name not in images]
    if missing:
        raise ValueError(f"the report refers to images that were not given: {', '.join(missing)}")


def strip_frames(frames: int) -> list[int]:
    """The frames a strip of a clip shows: every k-th from the first, at most STRIP_FRAMES."""
    return list(range(0, frames, math.ceil(frames / STRIP_FRAMES)))


def frame_strip(clip: np.ndarray) -> np.ndarray:
    """The strip_frames of a clip [F, H, W, C] side by side, STRIP_GAP white columns apart: one [H, W', C] image."""
    gap = np.full((clip.shape[1], STRIP_GAP, *clip.shape[3:]), 255, dtype=clip.dtype)
    shown = [clip[index] for index in strip_frames(len(clip))]
    return np.concatenate([part for frame in shown for part in (gap, frame)][1:], axis=1)


def preview_name(png: str) -> str:
    """A clip's looped preview: beside its strip, `<strip stem>.webp`."""
    return str(PurePosixPath(png).with_suffix(".webp"))


def animated_webp(clip: np.ndarray, fps: float = DEFAULT_FPS) -> bytes:
    """A clip [F, H, W, 3] as a looped animated WebP at `fps`."""
    from PIL import Image

    frames = [Image.fromarray(frame) for frame in clip]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:], duration=round(1000 / fps),
                   loop=0, quality=PREVIEW_QUALITY, method=0)  # method 0: libwebp's fastest, ample for a preview
    return buffer.getvalue()


def _clip_pair(image: ImageComparison, images: Mapping[str, np.ndarray]) -> bool:
    """Whether this comparison is of clips; refuses pixels of the wrong kind for it."""
    shapes = [np.shape(images[name]) for name in (image.reference_png, image.candidate_png)]
    clips = [len(shape) == 4 for shape in shapes]
    if image.video is None and any(clips):
        raise ValueError(f"{image.reference_png} / {image.candidate_png} are clips {shapes} but their comparison has "
                         "no video figures: compare clips with compare_image")
    if image.video is not None and not (all(clips) and all(shape[0] == image.video.frames for shape in shapes)):
        raise ValueError(f"{image.reference_png} / {image.candidate_png}: a video comparison of "
                         f"{image.video.frames} frames needs two clips of that many frames, got {shapes}")
    return image.video is not None


def _with_clip_files(
    report: ParityReport, images: Mapping[str, np.ndarray]
) -> tuple[ParityReport, dict[str, np.ndarray], dict[str, bytes]]:
    """The report with each clip comparison's strip frames and previews set, the images with each clip replaced by
    its frame strip, and the previews (WebP bytes) to write."""
    stills, previews = dict(images), {}
    variants = []
    for variant in report.variants:
        compared = []
        for image in variant.images:
            if not _clip_pair(image, images):
                compared.append(image)
                continue
            for name in (image.reference_png, image.candidate_png):
                if preview_name(name) not in previews:  # a clip several comparisons share is written once
                    stills[name] = frame_strip(np.asarray(images[name]))
                    previews[preview_name(name)] = animated_webp(np.asarray(images[name]))
            video = image.video.model_copy(update={
                "strip_frames": strip_frames(image.video.frames),
                "reference_preview": preview_name(image.reference_png),
                "candidate_preview": preview_name(image.candidate_png)})
            compared.append(image.model_copy(update={"video": video}))
        variants.append(variant.model_copy(update={"images": compared}))
    return report.model_copy(update={"variants": variants}), stills, previews


def _with_heatmaps(
    report: ParityReport, images: Mapping[str, np.ndarray]
) -> tuple[ParityReport, dict[str, np.ndarray]]:
    """The report with each image's diff_png set, and the heatmaps to write."""
    heatmaps: dict[str, np.ndarray] = {}
    variants = []
    for variant in report.variants:
        compared = []
        for image in variant.images:
            name = diff_png_name(image.candidate_png)
            if name in images:
                raise ValueError(f"heatmap {name!r} would overwrite an image of the same name")
            heatmaps[name] = diff_heatmap(images[image.reference_png], images[image.candidate_png])
            compared.append(image.model_copy(update={"diff_png": name}))
        variants.append(variant.model_copy(update={"images": compared}))
    return report.model_copy(update={"variants": variants}), heatmaps


@dataclass(frozen=True)
class ReportFiles:
    """What write_report wrote."""

    json: Path
    schema: Path
    html: Path
    images: tuple[Path, ...]
    heatmaps: tuple[Path, ...]
    previews: tuple[Path, ...] = ()  # clips' looped WebPs


def write_report(report: ParityReport, images: Mapping[str, np.ndarray], out_dir: str | os.PathLike) -> ReportFiles:
    """Write parity.json, parity.schema.json, parity.html, the PNGs and their diff heatmaps into out_dir.

    `images` maps every reference_png / candidate_png (and init_png / mask_png) name in the report to its uint8
    pixels: an image [H, W, 3], or for a video comparison a clip [F, H, W, 3] (written as its frame strip and a
    looped WebP preview).
    Every file is written atomically, and parity.json last, so its presence means the report is complete.
    """
    out = Path(out_dir)
    _check_images_given(report, images)
    report, images, previews = _with_clip_files(report, images)
    report, heatmaps = _with_heatmaps(report, images)
    image_paths = tuple(_write_atomically(out / name, _png_bytes(pixels)) for name, pixels in images.items())
    heatmap_paths = tuple(_write_atomically(out / name, _png_bytes(pixels)) for name, pixels in heatmaps.items())
    preview_paths = tuple(_write_atomically(out / name, data) for name, data in previews.items())
    schema_text = json.dumps(ParityReport.model_json_schema(), indent=2)
    schema_path = _write_atomically(out / REPORT_SCHEMA, schema_text.encode())
    html_path = _write_atomically(out / REPORT_HTML, render_html(report).encode())
    json_path = _write_atomically(out / REPORT_JSON, report.model_dump_json(indent=2).encode())
    return ReportFiles(json=json_path, schema=schema_path, html=html_path, images=image_paths, heatmaps=heatmap_paths,
                       previews=preview_paths)


def read_report(path: str | os.PathLike) -> ParityReport:
    """Load and validate a parity.json."""
    return ParityReport.model_validate_json(Path(path).read_bytes())
