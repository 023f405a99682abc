"""The release-gate commands: parity (same-seed images vs PyTorch) and preflight (the pre-launch checklist)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .console import console, err_console
from .options import ConfigArg
from .preflight_command import preflight_command


def parity_command(
    config: ConfigArg,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="a text file, one prompt a line")] = None,
    seeds: Annotated[list[int] | None, typer.Option("--seeds", help="repeat for several seeds")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, max=200)] = 4,
    out: Annotated[Path | None, typer.Option("--out", help="report folder (default <workspace>/reports/parity)")] = None,
    target: Annotated[list[str] | None, typer.Option("--target")] = None,
):
    """Compare every built engine variant's images with the PyTorch reference; fails when a gate fails."""
    from .. import api
    from ..errors import ParityError
    from .parity_summary import render_summary

    with err_console.status("parity") as status:
        run = api.parity(config, out_dir=out, prompts_file=prompts, seeds=seeds, steps=steps, targets=target,
                         progress=lambda message: status.update(message))
    console.print(render_summary(run.report))
    console.print(f"report: {run.files.html}  (JSON: {run.files.json})")
    if not run.report.passed:
        failed = [v for v in run.report.variants if not v.passed]
        engines = sorted({name for v in failed for name in v.failing_engines})
        blame = f" — failing engines: {', '.join(engines)}" if engines else ""
        details = "; ".join(f"{v.variant_id}: {v.failure_reasons[0]}" for v in failed[:3]) + blame
        raise ParityError(f"{len(failed)} of {len(run.report.variants)} variants failed parity: {details}")


COMMANDS = {"parity": parity_command, "preflight": preflight_command}
