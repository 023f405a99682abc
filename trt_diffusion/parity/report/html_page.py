"""The self-contained HTML page of a parity report, rendered from `report_templates/templates/parity.html.j2`."""

from __future__ import annotations

from ...report_templates import render_page
from . import text
from .heatmap import HEATMAP_GAIN
from .model import ParityReport

TEMPLATE = "parity.html.j2"


def render_html(report: ParityReport) -> str:
    """Summary table, then per variant the reference | candidate | diff grid, or a clip pair's previews and frame
    strips (autoescaped)."""
    return render_page(
        TEMPLATE,
        report=report,
        passed=report.passed,
        fmt=text,
        heatmap_label=f"|diff| ×{HEATMAP_GAIN:g}",
        has_video=any(image.video for variant in report.variants for image in variant.images),
        versions=", ".join(f"{name} {version}" for name, version in report.tool_versions.items()),
    )
