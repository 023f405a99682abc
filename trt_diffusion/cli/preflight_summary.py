"""The preflight report's one-screen summary: a rich table, one row per check, with its first failure."""

from __future__ import annotations

from ..preflight.model import PreflightReport


def render_summary(report: PreflightReport):
    from rich.table import Table
    from rich.text import Text

    verdict = "[bold green]PASS[/bold green]" if report.passed else "[bold red]FAIL[/bold red]"
    where = report.deployment.url or report.deployment.kind
    table = Table(title=f"preflight {report.model} ({report.target}, {where}): {verdict}", title_justify="left")
    for column in ("#", "check", "result", "measured", "s"):
        table.add_column(column, justify="right" if column in ("#", "s") else "left",
                         no_wrap=column in ("check", "result"))
    for index, check in enumerate(report.checks, 1):
        style = {"pass": "green", "fail": "bold red"}.get(check.status, "yellow")
        measured = check.summary if not check.failures else f"{check.summary}\n→ {check.failures[0]}"
        table.add_row(str(index), check.name, Text(check.status.upper(), style=style), Text(measured),
                      f"{check.seconds:.1f}")
    return table
