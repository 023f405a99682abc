"""The report's files: PNGs, |diff| heatmaps, JSON + JSON Schema and the HTML page, each written atomically."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...workspace.files import atomic_write_bytes
from .heatmap import diff_heatmap, diff_png_name
from .html_page import render_html
from .model import ParityReport, relative_png_name

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


def write_report(report: ParityReport, images: Mapping[str, np.ndarray], out_dir: str | os.PathLike) -> ReportFiles:
    """Write parity.json, parity.schema.json, parity.html, the PNGs and their diff heatmaps into out_dir.

    `images` maps every reference_png / candidate_png (and init_png / mask_png) name in the report to its uint8
    pixels.
    Every file is written atomically, and parity.json last, so its presence means the report is complete.
    """
    out = Path(out_dir)
    _check_images_given(report, images)
    report, heatmaps = _with_heatmaps(report, images)
    image_paths = tuple(_write_atomically(out / name, _png_bytes(pixels)) for name, pixels in images.items())
    heatmap_paths = tuple(_write_atomically(out / name, _png_bytes(pixels)) for name, pixels in heatmaps.items())
    schema_text = json.dumps(ParityReport.model_json_schema(), indent=2)
    schema_path = _write_atomically(out / REPORT_SCHEMA, schema_text.encode())
    html_path = _write_atomically(out / REPORT_HTML, render_html(report).encode())
    json_path = _write_atomically(out / REPORT_JSON, report.model_dump_json(indent=2).encode())
    return ReportFiles(json=json_path, schema=schema_path, html=html_path, images=image_paths, heatmaps=heatmap_paths)


def read_report(path: str | os.PathLike) -> ParityReport:
    """Load and validate a parity.json."""
    return ParityReport.model_validate_json(Path(path).read_bytes())
