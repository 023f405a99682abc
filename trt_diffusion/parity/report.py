"""Parity reports: the data model, and writers for JSON (+ JSON Schema), PNGs, diff heatmaps, HTML and
a one-screen terminal summary.

Non-finite floats (PSNR of identical images is inf; a NaN-producing engine gives NaN) are written to
JSON as the strings "Infinity", "-Infinity" and "NaN": plain JSON has no such numbers, a large
sentinel would read as a real measurement, and these strings round-trip through
`ParityReport.model_validate_json`, Python's `float()` and JavaScript's `Number()`.
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import platform
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Iterable, Literal, Mapping, Sequence
from urllib.parse import quote

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from rich.table import Table
from rich.text import Text

from trt_diffusion.parity.metrics import Thresholds, TensorDiff, lpips_distance, psnr, ssim

REPORT_SCHEMA_VERSION = 1
REPORT_JSON = "parity.json"
REPORT_SCHEMA = "parity.schema.json"
REPORT_HTML = "parity.html"
HEATMAP_GAIN = 8.0  # a heatmap pixel reaches full scale at |diff| >= 255 / 8 ~ 32 grey levels

# Package distributions whose versions a report records (those not installed are left out).
_VERSIONED_DISTRIBUTIONS = (
    "trt-diffusion", "torch", "diffusers", "transformers", "onnx", "onnxruntime", "tensorrt",
    "nvidia-modelopt", "numpy", "scikit-image", "lpips",
)


# --- data model ------------------------------------------------------------------------------


def _relative_png_name(name: str) -> str:
    """A PNG path relative to the report folder: no absolute paths, no '..', no backslashes."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name or str(path) != name:
        raise ValueError(f"{name!r} must be a plain relative path inside the report folder")
    if path.suffix.lower() != ".png":
        raise ValueError(f"{name!r} must be a .png file")
    return name


PngName = Annotated[str, AfterValidator(_relative_png_name)]

# A float that may be inf or NaN: serialized as "Infinity"/"-Infinity"/"NaN" (see module docstring),
# and the JSON Schema says so.
MetricFloat = Annotated[
    float,
    WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": ["Infinity", "-Infinity", "NaN"]}]}),
]


class _ReportModel(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class ImageComparison(_ReportModel):
    """One same-seed image pair: the reference pipeline's image against the engine pipeline's."""

    prompt: str
    seed: int = Field(description="the generator seed both pipelines used")
    psnr_db: MetricFloat = Field(description='PSNR in dB over 8-bit RGB; "Infinity" when identical')
    ssim: MetricFloat = Field(description="SSIM, 1.0 when identical")
    lpips: MetricFloat | None = Field(
        default=None, description="LPIPS (AlexNet), 0 when identical; null if not computed"
    )
    lpips_reason: str | None = Field(default=None, description="why lpips is null")
    passed: bool = Field(description="whether this image meets the variant's thresholds")
    reference_png: PngName = Field(description="the reference image, relative to the report folder")
    candidate_png: PngName = Field(description="the engine's image, relative to the report folder")
    diff_png: PngName | None = Field(default=None, description="the |diff| heatmap, written by write_report")

    @model_validator(mode="after")
    def _lpips_has_value_or_reason(self) -> "ImageComparison":
        if self.lpips is None and not self.lpips_reason:
            raise ValueError("lpips_reason is required when lpips is null")
        return self


class ComponentDiff(_ReportModel):
    """One output of one component (e.g. unet.out_sample) against the PyTorch reference."""

    component: str
    output: str
    shape: list[int]
    max_abs: MetricFloat = Field(description="max |reference - candidate| over positions finite in both")
    mean_abs: MetricFloat = Field(description="mean |reference - candidate| over positions finite in both")
    max_rel: MetricFloat = Field(description="max_abs / max |reference|")
    nan_count: int = Field(ge=0, description="NaN values in the candidate")
    inf_count: int = Field(ge=0, description="+-inf values in the candidate")

    @classmethod
    def from_tensor_diff(cls, component: str, output: str, diff: TensorDiff) -> "ComponentDiff":
        return cls(
            component=component,
            output=output,
            shape=list(diff.shape),
            max_abs=diff.max_abs,
            mean_abs=diff.mean_abs,
            max_rel=diff.max_rel,
            nan_count=diff.nan_count,
            inf_count=diff.inf_count,
        )


class VariantResult(_ReportModel):
    """Everything compared for one engine variant (model x target x precision x bucket x lora/controlnet)."""

    variant_id: str = Field(description="unique within the report")
    model: str
    target: str = Field(description="tensorrt or onnxruntime")
    precision: str = Field(description="fp32, fp16, bf16, fp8 or int8; selects the default thresholds")
    bucket: str = Field(description="the resolution bucket label, e.g. 512x512 or 512x512..1024x1024")
    lora: str | None = None
    controlnet: str | None = None
    thresholds: Thresholds = Field(description="the bar the images were judged against")
    images: list[ImageComparison] = Field(default_factory=list)
    components: list[ComponentDiff] = Field(default_factory=list)
    reproducible: bool | None = Field(
        default=None, description="same seed twice gave identical images; null: not checked"
    )
    batch_independent: bool | None = Field(
        default=None, description="images do not change with their batch; null: not checked"
    )
    passed: bool
    failure_reasons: list[str] = Field(default_factory=list, description="empty exactly when passed")

    @model_validator(mode="after")
    def _verdict_matches_reasons(self) -> "VariantResult":
        # A failure must say why, and a pass must not hide a failed image.
        if self.passed and (self.failure_reasons or not all(image.passed for image in self.images)):
            raise ValueError(f"variant {self.variant_id!r} is marked passed but has failures")
        if not self.passed and not self.failure_reasons:
            raise ValueError(f"variant {self.variant_id!r} is marked failed without a failure reason")
        return self

    @classmethod
    def from_parts(
        cls,
        *,
        variant_id: str,
        model: str,
        target: str,
        precision: str,
        bucket: str,
        thresholds: Thresholds,
        images: Sequence[ImageComparison],
        components: Sequence[ComponentDiff] = (),
        reproducible: bool | None = None,
        batch_independent: bool | None = None,
        lora: str | None = None,
        controlnet: str | None = None,
        extra_failures: Sequence[str] = (),
    ) -> "VariantResult":
        """Judge the parts against `thresholds`: sets each image's `passed`, the reasons and the verdict."""
        judged = [_judge_image(image, thresholds) for image in images]
        reasons = variant_failures(judged, thresholds, components, reproducible, batch_independent)
        reasons += list(extra_failures)
        return cls(
            variant_id=variant_id,
            model=model,
            target=target,
            precision=precision,
            bucket=bucket,
            lora=lora,
            controlnet=controlnet,
            thresholds=thresholds,
            images=judged,
            components=list(components),
            reproducible=reproducible,
            batch_independent=batch_independent,
            passed=not reasons,
            failure_reasons=reasons,
        )


class ParityReport(_ReportModel):
    """The whole parity run: one VariantResult per engine variant. Passes only if every variant does."""

    schema_version: Literal[1] = REPORT_SCHEMA_VERSION
    created_at: datetime
    tool_versions: dict[str, str] = Field(default_factory=dict)
    variants: list[VariantResult]
    passed: bool

    @model_validator(mode="after")
    def _consistent(self) -> "ParityReport":
        ids = [variant.variant_id for variant in self.variants]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate variant ids: {duplicates}")
        # An empty report does not pass: comparing nothing proves nothing.
        expected = bool(self.variants) and all(variant.passed for variant in self.variants)
        if self.passed != expected:
            raise ValueError(f"report passed={self.passed} but its variants say {expected}")
        return self

    @classmethod
    def from_variants(
        cls,
        variants: Sequence[VariantResult],
        tool_versions: Mapping[str, str] | None = None,
        created_at: datetime | None = None,
    ) -> "ParityReport":
        variants = list(variants)
        return cls(
            created_at=created_at or datetime.now(timezone.utc),
            tool_versions=dict(collect_tool_versions() if tool_versions is None else tool_versions),
            variants=variants,
            passed=bool(variants) and all(variant.passed for variant in variants),
        )


# --- judging ---------------------------------------------------------------------------------


def collect_tool_versions() -> dict[str, str]:
    """Python and the installed versions of the packages that shape a parity result."""
    versions = {"python": platform.python_version()}
    for distribution in _VERSIONED_DISTRIBUTIONS:
        try:
            versions[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return versions


def compare_image(
    *,
    prompt: str,
    seed: int,
    reference: np.ndarray,
    candidate: np.ndarray,
    thresholds: Thresholds,
    reference_png: str,
    candidate_png: str,
    compute_lpips: bool = True,
) -> ImageComparison:
    """PSNR, SSIM and (when available) LPIPS of two uint8 HxWx3 images, judged against `thresholds`."""
    psnr_db, ssim_value = psnr(reference, candidate), ssim(reference, candidate)
    if compute_lpips:
        lpips_result = lpips_distance(reference, candidate)
        lpips_value, lpips_reason = lpips_result.value, lpips_result.reason
    else:
        lpips_value, lpips_reason = None, "LPIPS not computed: disabled for this run"
    failures = thresholds.image_failures(psnr_db, ssim_value, lpips_value, lpips_reason)
    return ImageComparison(
        prompt=prompt,
        seed=seed,
        psnr_db=psnr_db,
        ssim=ssim_value,
        lpips=lpips_value,
        lpips_reason=lpips_reason,
        passed=not failures,
        reference_png=reference_png,
        candidate_png=candidate_png,
    )


def _image_failures(image: ImageComparison, thresholds: Thresholds) -> list[str]:
    return thresholds.image_failures(image.psnr_db, image.ssim, image.lpips, image.lpips_reason)


def _judge_image(image: ImageComparison, thresholds: Thresholds) -> ImageComparison:
    return image.model_copy(update={"passed": not _image_failures(image, thresholds)})


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def variant_failures(
    images: Sequence[ImageComparison],
    thresholds: Thresholds,
    components: Iterable[ComponentDiff] = (),
    reproducible: bool | None = None,
    batch_independent: bool | None = None,
) -> list[str]:
    """Every reason a variant fails, in a stable order (empty when it passes)."""
    reasons = [] if images else ["no images were compared"]
    for index, image in enumerate(images):
        failures = _image_failures(image, thresholds)
        if failures:
            reasons.append(f"image {index} (seed {image.seed}, {_short(image.prompt)!r}): " + "; ".join(failures))
    for diff in components:
        if diff.nan_count or diff.inf_count:
            reasons.append(f"{diff.component}.{diff.output}: {diff.nan_count} NaN and {diff.inf_count} inf values")
    if reproducible is False:
        reasons.append("not reproducible: the same seed gave different images on two runs")
    if batch_independent is False:
        reasons.append("batch-dependent: an image changed with the batch it was generated in")
    return reasons


# --- formatting ------------------------------------------------------------------------------


def _format_db(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "∞ dB" if value > 0 else "-∞ dB"
    return "NaN" if math.isnan(value) else f"{value:.2f} dB"


def _format_ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return "NaN" if math.isnan(value) else f"{value:.4f}"


def _worst(values: Sequence[float], lower_is_worse: bool) -> float | None:
    """The worst value; NaN counts as worst of all (it means a broken output)."""
    if not values:
        return None
    if any(math.isnan(v) for v in values):
        return math.nan
    return min(values) if lower_is_worse else max(values)


def min_psnr(variant: VariantResult) -> float | None:
    return _worst([image.psnr_db for image in variant.images], lower_is_worse=True)


def min_ssim(variant: VariantResult) -> float | None:
    return _worst([image.ssim for image in variant.images], lower_is_worse=True)


def max_lpips(variant: VariantResult) -> float | None:
    return _worst([image.lpips for image in variant.images if image.lpips is not None], lower_is_worse=False)


def _lpips_note(variant: VariantResult) -> str:
    """The LPIPS column: the worst value, or 'n/a' when no image has one."""
    worst = max_lpips(variant)
    return "n/a" if worst is None else _format_ratio(worst)


def _lpips_missing_reason(variant: VariantResult) -> str:
    return next((image.lpips_reason for image in variant.images if image.lpips_reason), "")


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


# --- heatmaps and files ----------------------------------------------------------------------

# An inferno-like ramp: black -> purple -> red -> orange -> pale yellow.
_HEATMAP_STOPS = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
_HEATMAP_COLORS = np.array(
    [[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], dtype=np.float64
)


def diff_heatmap(reference: np.ndarray, candidate: np.ndarray, gain: float = HEATMAP_GAIN) -> np.ndarray:
    """A uint8 HxWx3 picture of |reference - candidate| (worst channel), amplified by `gain`."""
    if reference.shape != candidate.shape:
        raise ValueError(f"shape mismatch: reference {reference.shape} vs candidate {candidate.shape}")
    diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
    if diff.ndim == 3:
        diff = diff.max(axis=-1)
    level = np.clip(np.nan_to_num(diff, nan=255.0) * gain / 255.0, 0.0, 1.0)
    channels = [np.interp(level, _HEATMAP_STOPS, _HEATMAP_COLORS[:, c]) for c in range(3)]
    return np.rint(np.stack(channels, axis=-1)).astype(np.uint8)


def diff_png_name(candidate_png: str) -> str:
    """The heatmap's file name: next to the candidate, `<candidate stem>.diff.png`."""
    path = PurePosixPath(candidate_png)
    return str(path.with_name(f"{path.stem}.diff.png"))


def _write_atomically(path: Path, data: bytes) -> Path:
    """Write to a temporary file in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as temp_file:
            temp_file.write(data)
            temp_file.flush()
            os.fsync(temp_file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
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
    return list(dict.fromkeys(names))


def _check_images_given(report: ParityReport, images: Mapping[str, np.ndarray]) -> None:
    for name in images:
        _relative_png_name(name)
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

    `images` maps every reference_png / candidate_png name in the report to its uint8 pixels.
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


# --- HTML ------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
.pass { color: #17702a; font-weight: bold; }
.fail { color: #b3141b; font-weight: bold; }
.grid { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 0.5em; max-width: 60em; }
.grid .caption { grid-column: 1 / -1; margin-top: 1em; }
figure { margin: 0; } figure img { width: 100%; image-rendering: pixelated; }
figcaption, .note { font-size: 0.85em; color: #555; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: Any, css_class: str = "", title: str = "") -> str:
    attributes = (f' class="{_e(css_class)}"' if css_class else "") + (f' title="{_e(title)}"' if title else "")
    return f"<td{attributes}>{_e(value)}</td>"


def _img(src: str, alt: str) -> str:
    return f'<img src="{_e(quote(src))}" alt="{_e(alt)}" loading="lazy">'


def _summary_table(report: ParityReport) -> str:
    header = "".join(
        f"<th>{_e(name)}</th>"
        for name in ("variant", "target", "precision", "bucket", "min PSNR", "min SSIM", "LPIPS", "result")
    )
    rows = []
    for index, variant in enumerate(report.variants):
        verdict = _verdict(variant.passed)
        rows.append(
            "<tr>"
            f'<td><a href="#variant-{index}">{_e(variant.variant_id)}</a></td>'
            + _cell(variant.target)
            + _cell(variant.precision)
            + _cell(variant.bucket)
            + _cell(_format_db(min_psnr(variant)))
            + _cell(_format_ratio(min_ssim(variant)))
            + _cell(_lpips_note(variant), title=_lpips_missing_reason(variant))
            + _cell(verdict, css_class=verdict.lower())
            + "</tr>"
        )
    return f'<table id="summary"><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _thresholds_text(thresholds: Thresholds) -> str:
    text = f"PSNR ≥ {thresholds.min_psnr_db:g} dB, SSIM ≥ {thresholds.min_ssim:g}"
    return text + (f", LPIPS ≤ {thresholds.max_lpips:g}" if thresholds.max_lpips is not None else ", LPIPS not gated")


def _check_text(value: bool | None) -> str:
    return "not checked" if value is None else ("yes" if value else "NO")


def _components_table(components: Sequence[ComponentDiff]) -> str:
    if not components:
        return ""
    header = "".join(
        f"<th>{_e(name)}</th>"
        for name in ("component", "output", "shape", "max abs", "mean abs", "max rel", "NaN", "inf")
    )
    rows = "".join(
        "<tr>"
        + "".join(
            _cell(value)
            for value in (
                diff.component, diff.output, "×".join(map(str, diff.shape)),
                f"{diff.max_abs:.3g}", f"{diff.mean_abs:.3g}", f"{diff.max_rel:.3g}", diff.nan_count, diff.inf_count,
            )
        )
        + "</tr>"
        for diff in components
    )
    return f'<table class="components"><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>'


def _image_rows(images: Sequence[ImageComparison]) -> str:
    cells = []
    for image in images:
        verdict = _verdict(image.passed)
        lpips_text = _format_ratio(image.lpips) if image.lpips is not None else "n/a"  # reason: once per variant
        cells.append(
            f'<div class="caption"><span class="{verdict.lower()}">{verdict}</span> '
            f"seed {_e(image.seed)} — {_e(image.prompt)} — PSNR {_e(_format_db(image.psnr_db))}, "
            f"SSIM {_e(_format_ratio(image.ssim))}, LPIPS {_e(lpips_text)}</div>"
        )
        for src, label in (
            (image.reference_png, "reference"),
            (image.candidate_png, "candidate"),
            (image.diff_png, f"|diff| ×{HEATMAP_GAIN:g}"),
        ):
            if src:
                cells.append(f"<figure>{_img(src, label)}<figcaption>{_e(label)}</figcaption></figure>")
    return f'<div class="grid">{"".join(cells)}</div>'


def _variant_section(index: int, variant: VariantResult) -> str:
    verdict = _verdict(variant.passed)
    facts = [
        f"model {variant.model}",
        f"target {variant.target}",
        f"precision {variant.precision}",
        f"bucket {variant.bucket}",
        f"LoRA {variant.lora or '—'}",
        f"ControlNet {variant.controlnet or '—'}",
        f"reproducible: {_check_text(variant.reproducible)}",
        f"batch-independent: {_check_text(variant.batch_independent)}",
    ]
    reasons = "".join(f"<li>{_e(reason)}</li>" for reason in variant.failure_reasons)
    return (
        f'<section id="variant-{index}">'
        f'<h2>{_e(variant.variant_id)} <span class="{verdict.lower()}">{verdict}</span></h2>'
        f"<p>{_e(' · '.join(facts))}</p>"
        f"<p>thresholds: {_e(_thresholds_text(variant.thresholds))}</p>"
        + (f'<p class="note">{_e(_lpips_missing_reason(variant))}</p>' if _lpips_missing_reason(variant) else "")
        + (f'<ul class="failures">{reasons}</ul>' if reasons else "")
        + _components_table(variant.components)
        + _image_rows(variant.images)
        + "</section>"
    )


def render_html(report: ParityReport) -> str:
    """A self-contained page: summary table, then per variant the reference | candidate | diff grid."""
    verdict = _verdict(report.passed)
    versions = ", ".join(f"{name} {version}" for name, version in report.tool_versions.items())
    sections = "".join(_variant_section(index, variant) for index, variant in enumerate(report.variants))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>Parity report: {verdict}</title><style>{_CSS}</style></head><body>"
        f'<h1>Parity report: <span class="{verdict.lower()}">{verdict}</span></h1>'
        f"<p>created {_e(report.created_at.isoformat())} · schema v{report.schema_version} · {_e(versions)}</p>"
        f"{_summary_table(report)}{sections}</body></html>\n"
    )


# --- terminal --------------------------------------------------------------------------------


def _verdict_style(passed: bool) -> str:
    return "green" if passed else "bold red"


def render_summary(report: ParityReport) -> Table:
    """One row per variant with its worst metrics and a colored PASS/FAIL, for rich's Console.print."""
    verdict = _verdict(report.passed)
    title = Text(f"Parity: {verdict} ({len(report.variants)} variants)", style=_verdict_style(report.passed))
    table = Table(title=title)
    columns = ("variant", "target", "precision", "bucket", "min PSNR", "min SSIM", "LPIPS", "result", "first failure")
    for column in columns:
        table.add_column(column, overflow="fold")
    for variant in report.variants:
        reasons = variant.failure_reasons
        first = reasons[0] + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "") if reasons else ""
        table.add_row(
            Text(variant.variant_id),  # Text, not markup: ids may contain '[' brackets
            Text(variant.target),
            Text(variant.precision),
            Text(variant.bucket),
            Text(_format_db(min_psnr(variant))),
            Text(_format_ratio(min_ssim(variant))),
            Text(_lpips_note(variant)),
            Text(_verdict(variant.passed), style=_verdict_style(variant.passed)),
            Text(first),
        )
    return table
