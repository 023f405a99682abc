"""preflight.json (+ its JSON Schema) and preflight.html, each written atomically, the JSON last: if it exists,
the report is complete."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..parity.report.files import _write_atomically, frame_strip
from .model import CheckResult, PreflightReport

REPORT_JSON = "preflight.json"
REPORT_SCHEMA = "preflight.schema.json"
REPORT_HTML = "preflight.html"
TEMPLATE = "preflight.html.j2"


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    schema: Path
    html: Path


def format_figure(value) -> str:
    """One figure as the page and the terminal show it."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "∞" if value > 0 else "-∞"
        if math.isnan(value):
            return "NaN"
        return f"{value:.4g}"
    return str(value)


def render_html(report: PreflightReport) -> str:
    from ..report_templates import render_page

    return render_page(TEMPLATE, report=report, passed=report.passed, fmt=format_figure,
                       versions=", ".join(f"{name} {version}" for name, version in report.tool_versions.items()),
                       columns=_columns)


def _columns(check: CheckResult) -> list[str]:
    return list(dict.fromkeys(key for row in check.rows for key in row))


def write_report(report: PreflightReport, out_dir: str | Path, images=None) -> ReportFiles:
    """`images`: PNG name (relative, as the report's rows give it) -> uint8 pixels, written before the report."""
    import io

    from PIL import Image

    from ..parity.report.model import relative_png_name

    out = Path(out_dir)
    for name, pixels in (images or {}).items():
        buffer = io.BytesIO()
        # a video model's clip [F, H, W, 3] is shown as its frame strip, as the parity report shows it
        Image.fromarray(frame_strip(pixels) if pixels.ndim == 4 else pixels).save(buffer, format="PNG")
        _write_atomically(out / relative_png_name(name), buffer.getvalue())
    schema = _write_atomically(out / REPORT_SCHEMA, json.dumps(PreflightReport.model_json_schema(), indent=2).encode())
    html = _write_atomically(out / REPORT_HTML, render_html(report).encode())
    path = _write_atomically(out / REPORT_JSON, report.model_dump_json(indent=2).encode())
    return ReportFiles(path, schema, html)


def read_report(path: str | Path) -> PreflightReport:
    return PreflightReport.model_validate_json(Path(path).read_bytes())
