"""The parity report's one-screen terminal summary (a rich Table)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ..parity.report.model import ParityReport
from ..parity.report.text import first_failure, format_db, format_ratio, lpips_note, min_psnr, min_ssim, verdict


def _verdict_style(passed: bool) -> str:
    return "green" if passed else "bold red"


def render_summary(report: ParityReport) -> Table:
    """One row per variant with its worst metrics and a colored PASS/FAIL, for rich's Console.print."""
    title = f"Parity: {verdict(report.passed)} ({len(report.variants)} variants)"
    table = Table(title=Text(title, style=_verdict_style(report.passed)))
    columns = ("variant", "target", "precision", "bucket", "min PSNR", "min SSIM", "LPIPS", "result", "first failure")
    for column in columns:
        table.add_column(column, overflow="fold")
    for variant in report.variants:
        table.add_row(
            Text(variant.variant_id),  # Text, not markup: ids may contain '[' brackets
            Text(variant.target),
            Text(variant.precision),
            Text(variant.bucket),
            Text(format_db(min_psnr(variant))),
            Text(format_ratio(min_ssim(variant))),
            Text(lpips_note(variant)),
            Text(verdict(variant.passed), style=_verdict_style(variant.passed)),
            Text(first_failure(variant)),
        )
    return table
