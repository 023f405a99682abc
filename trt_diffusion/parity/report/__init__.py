"""Parity reports: the data model (`model`), judging (`judge`), the files (`files`: JSON + JSON Schema,
PNGs, diff heatmaps; clips as frame strips and looped previews) and the HTML page from Jinja2 templates
(`html_page`); the terminal summary is the CLI's (`cli/parity_summary.py`). Import from here; the submodules are
the seams, not separate APIs."""

from .files import REPORT_HTML, REPORT_JSON, REPORT_SCHEMA, ReportFiles, read_report, write_report
from .heatmap import HEATMAP_GAIN, diff_heatmap, diff_png_name
from .html_page import render_html
from .judge import collect_tool_versions, compare_image, judge_report, judge_variant, variant_failures
from .model import (
    REPORT_SCHEMA_VERSION,
    ComponentDiff,
    ImageComparison,
    ParityReport,
    VariantResult,
    VideoComparison,
)
from .text import max_lpips, min_psnr, min_ssim

__all__ = [
    "HEATMAP_GAIN", "REPORT_HTML", "REPORT_JSON", "REPORT_SCHEMA", "REPORT_SCHEMA_VERSION", "ComponentDiff",
    "ImageComparison", "ParityReport", "ReportFiles", "VariantResult", "VideoComparison", "collect_tool_versions",
    "compare_image", "diff_heatmap", "diff_png_name", "judge_report", "judge_variant",
    "max_lpips", "min_psnr", "min_ssim", "read_report", "render_html",
    "variant_failures", "write_report",
]
