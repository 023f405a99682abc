"""The `preflight` command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..checklist import CHECK_NAMES
from .console import console
from .options import Transport


def preflight_command(
    config: Annotated[Path, typer.Argument(help="engines.yaml")],
    url: Annotated[str | None, typer.Option("--url", help="HOST:PORT of a running server (default: package the "
                                               "built engines and start one on 127.0.0.1)")] = None,
    protocol: Annotated[Transport, typer.Option("--protocol", case_sensitive=False, help="grpc can cancel; http cannot (cancellation n/a)")]
    = Transport.grpc,
    metrics_url: Annotated[str | None, typer.Option("--metrics-url", help="HOST:PORT of the server's metrics "
                                                       "(with --url; default HOST:8002)")] = None,
    only: Annotated[list[str] | None, typer.Option("--only", help=f"run only these: {', '.join(CHECK_NAMES)}")]
    = None,
    skip: Annotated[list[str] | None, typer.Option("--skip", help="leave these out")] = None,
    save_baseline: Annotated[bool, typer.Option("--save-baseline", help="store the quality check's images as the "
                                                "baseline (tied to these engines' keys)")] = False,
    save_baseline_if_missing: Annotated[bool, typer.Option(
        "--save-baseline-if-missing", help="--save-baseline when this file's model has no baseline yet (a first "
        "run; `make preflight`)")] = False,
    model: Annotated[str | None, typer.Option("--model", help="default: preflight.model or the only model")]
    = None,
    target: Annotated[str | None, typer.Option("--target", help="whose engines (default preflight.target)")]
    = None,
    out: Annotated[Path | None, typer.Option("--out", help="report folder (default "
                                                "<workspace>/reports/preflight)")] = None,
    in_process: Annotated[bool, typer.Option("--in-process", help="no server: the pipeline in this process")]
    = False,
):
    """Run the pre-launch checklist against a Triton server; exit 1 when a check fails."""
    from .. import api
    from ..preflight.errors import PreflightError
    from .preflight_summary import render_summary

    only = [n for item in only or [] for n in item.split(",") if n]
    skip = [n for item in skip or [] for n in item.split(",") if n]
    with console.status("preflight") as status:
        run = api.preflight(config, url=url, protocol=protocol.value, metrics_url=metrics_url, only=only or None,
                            skip=skip or None, save_baseline=save_baseline, model=model, target=target, out_dir=out,
                            in_process=in_process, progress=lambda message: status.update(message),
                            save_baseline_if_missing=save_baseline_if_missing)
    console.print(render_summary(run.report))
    if run.baseline is not None:
        console.print(f"baseline saved: {run.baseline}")
    console.print(f"report: {run.files.html}  (JSON: {run.files.json})")
    if not run.report.passed:
        failed = [c for c in run.report.checks if c.status == "fail"]
        raise PreflightError(f"{len(failed)} of {len(run.report.checks)} checks failed: "
                             + "; ".join(f"{c.name}: {c.failures[0]}" for c in failed))
