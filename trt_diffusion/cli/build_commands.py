"""The engine-matrix commands: plan, export, quantize, build, manifest, refit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..targets import target_names
from .console import console, err_console, human_bytes
from .options import ConfigArg


def plan_command(config: ConfigArg, as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False):
    """Show the engines engines.yaml asks for: how many, why, and their estimated size."""
    from .. import api

    result = api.plan(config)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    table = Table(title=f"Engine plan for {config}")
    for column in ("model", "component", "target", "precision", "engines", "params", "est. disk", "why"):
        numeric = column in ("engines", "params", "est. disk")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=column != "why")
    for row in result.rows:
        params = f"{row.parameters / 1e6:.2f}M" if row.parameters is not None else "?"
        table.add_row(row.model, row.component, row.target + (" *" if row.not_here else ""), row.precision, str(row.engines), params,
                      human_bytes(row.disk_bytes), row.formula + (f"; {row.runs_as}" if row.runs_as else ""))
    console.print(table)
    console.print("batch shapes are the engine's batch: the image batch, doubled where CFG runs batched. "
                  "`--json` lists every engine with its key and reasons.")
    console.print(f"[bold]{result.total_engines} engines[/bold], about {human_bytes(result.total_disk_bytes)} on disk"
                  f"; {result.buildable_here} buildable on this machine")
    for row in result.rows:
        if row.layouts and row.layouts["per_shape_engines"] > row.layouts["profiles_engines"]:
            layout = row.layouts
            console.print(f"{row.model} {row.component} ({row.target}) device weights: per_shape "
                          f"{human_bytes(layout['per_shape_bytes'])} ({layout['per_shape_engines']} engines) · "
                          f"profiles {human_bytes(layout['profiles_bytes'])} ({layout['profiles_engines']} "
                          f"engine{'s' if layout['profiles_engines'] > 1 else ''})", soft_wrap=True, highlight=False)
    for model, notes in result.workflows.items():
        if list(notes) != ["txt2img"]:
            for workflow, note in notes.items():
                console.print(f"{model} workflow {workflow}: {note}", soft_wrap=True, highlight=False)
    reasons = dict.fromkeys((row.target, row.not_here) for row in result.rows if row.not_here)
    for target, reason in reasons:
        console.print(f"[yellow]not buildable here[/yellow] ({target}, marked *): {reason}", soft_wrap=True,
                      highlight=False)


def export_command(
    config: ConfigArg,
    model: Annotated[str | None, typer.Option("--model", help="only this model of engines.yaml")] = None,
    component: Annotated[str | None, typer.Option("--component", help="only this component (e.g. unet)")] = None,
):
    """Export the components engines.yaml needs to ONNX, each verified against PyTorch (cached when unchanged)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .. import api

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task("export", total=None)

        def on_event(event) -> None:
            done = event.index + (1 if event.stage in ("cached", "done") else 0)
            progress.update(task, total=event.total, completed=done,
                            description=f"{event.group.name}: {event.stage}")

        report = api.export(config, model=model, component=component, progress=on_event)
    table = Table(title=f"ONNX exports for {config}")
    for column in ("component", "shapes", "status", "seconds", "max rel. error"):
        numeric = column in ("seconds", "max rel. error")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=column == "component")
    for result in report.results:
        error = result.max_rel_error
        table.add_row(result.group.name, result.shapes_label, "cached" if result.cached else "exported",
                      f"{result.seconds:.1f}", "-" if error is None else f"{error:.1e}")
    console.print(table)
    exported = sum(not r.cached for r in report.results)
    console.print(f"[bold]{len(report.results)} ONNX graphs[/bold] for {len(report.by_spec)} engines: "
                  f"{exported} exported, {len(report.results) - exported} unchanged (cached). Max rel. error is "
                  "ONNX Runtime vs PyTorch over every output and checked shape.")
    if report.results:
        console.print(f"artifacts: {report.results[0].artifact.path.parent}")


def quantize_command(
    config: ConfigArg,
    model: Annotated[str | None, typer.Option("--model")] = None,
    force: Annotated[bool, typer.Option("--force", help="recalibrate and re-export even when cached")] = False,
):
    """ModelOpt FP8/INT8 for the fp8/int8 entries: seeded calibration, Q/DQ ONNX, quality gate."""
    from .. import api

    with err_console.status("quantizing (calibration runs the real pipeline)"):
        report = api.quantize(config, model, force=force)
    table = Table(title=f"Quantized artifacts for {config}")
    for column in ("variant", "status", "gate"):
        table.add_column(column)
    for artifact in report.artifacts:
        gate = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in artifact.gate.items() if not isinstance(v, (dict, list)))
        label = f"{artifact.model}.{artifact.component}{'.lora-' + artifact.lora if artifact.lora else ''}.{artifact.precision}"
        table.add_row(label, "cached" if artifact.cached else "quantized", gate)
    console.print(table)
    if not report.artifacts:
        console.print("no fp8/int8 entries in engines.yaml: nothing to quantize")


def build_command(
    config: ConfigArg,
    target: Annotated[str | None, typer.Option("--target", help=f"{' | '.join(target_names())} (default: "
                                                  "every target engines.yaml lists that this machine can build)")]
    = None,
    model: Annotated[str | None, typer.Option("--model")] = None,
    component: Annotated[str | None, typer.Option("--component")] = None,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", min=1, help="parallel builds (default: build.jobs)")] = None,
    shard: Annotated[str | None, typer.Option("--shard", help="I/N: build the I-th of N deterministic parts of "
                                                 "the matrix (CI matrices sharing one workspace)")] = None,
    ray: Annotated[str | None, typer.Option("--ray", help="auto or HOST:PORT: one Ray task per engine on a "
                                               "cluster sharing the workspace (extra: farm)")] = None,
):
    """Build one engine per shape (exporting first); unchanged engines are reused."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .. import api
    from ..errors import BuildError, InternalError

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    from ..progress import task as progress_lines

    with Progress(*columns, console=err_console, transient=True) as progress, \
            progress_lines("build", detail="exports, then one engine per shape") as lines:
        task = progress.add_task("build", total=None)
        finished = []

        def on_engine(status, spec) -> None:  # from the build threads when --jobs > 1
            progress.advance(task)
            progress.update(task, description=f"{spec.name}: {status}")
            finished.append(spec.name)
            lines.step(detail=f"{len(finished)} engines finished, last {spec.name}: {status}", force=True)

        from ..engine_builds.shards import parse_shard

        report = api.build(config, target=target, model=model, component=component, jobs=jobs,
                           shard=parse_shard(shard) if shard else None, ray=ray, progress=on_engine)
    table = Table(title=f"Engines for {config}")
    for column in ("engine", "target", "status", "seconds"):
        table.add_column(column, justify="right" if column == "seconds" else "left", no_wrap=column != "status")
    for outcome in report.outcomes:
        status = "[red]FAILED[/red]" if outcome.error else ("cached" if outcome.cached else "built")
        table.add_row(outcome.spec.name, outcome.spec.target, status, f"{outcome.seconds:.1f}")
    console.print(table)
    for outcome in report.failed:
        console.print(f"[red]failed[/red] {outcome.spec.name} (key {outcome.spec.key}): "
                      f"{outcome.error}", highlight=False, soft_wrap=True)
    for name, reason in report.skipped_targets.items():
        console.print(f"[yellow]skipped target {name}[/yellow]: {reason}", soft_wrap=True)
    console.print(f"[bold]{len(report.outcomes)} engines[/bold]: {len(report.built)} built, {len(report.cached)} "
                  f"unchanged, {len(report.failed)} failed")
    if report.internal_failures:  # a bug, not bad input: show where it happened and exit 3
        for outcome in report.internal_failures:
            err_console.print(outcome.failure.traceback, highlight=False, markup=False, soft_wrap=True)
        names = ", ".join(o.spec.name for o in report.internal_failures)
        raise InternalError(f"{len(report.internal_failures)} engine(s) failed with an internal error: {names}")
    if report.failed:
        names = ", ".join(o.spec.name for o in report.failed)
        raise BuildError(f"{len(report.failed)} engine(s) failed to build: {names}")


def _parse_lora(text: str) -> tuple[Path, float]:
    path, _, scale = text.rpartition(":") if ":" in text else (text, "", "1.0")
    try:
        return Path(path), float(scale)
    except ValueError:
        raise typer.BadParameter(f"--lora {text!r}: expected FILE or FILE:SCALE (e.g. style.safetensors:0.8)")


def manifest_command(
    config: ConfigArg,
    out: Annotated[Path | None, typer.Option("--out", help="where to write it (default "
                                                "<workspace>/release-manifest.json)")] = None,
    verify: Annotated[bool, typer.Option("--verify-files/--no-verify", help="check every file's sha256")] = True,
    sign: Annotated[Path | None, typer.Option("--sign", help="private key (keys generate): sign the verified "
                                              "release manifest (on the release host)")] = None,
    verify_keys: Annotated[list[Path] | None, typer.Option("--verify", help="public key: check the signed release "
                                                           "manifest and the workspace against it (repeatable)")]
    = None,
):
    """The release manifest of every engine (provenance + sha256), verified; exit 1 if a file changed."""
    from .. import api
    from ..errors import BuildError

    if verify_keys:
        _verify_signed_manifest(config, out, verify_keys)
        return
    result = api.manifest(config, verify=verify, out=out)
    table = Table(title=f"release manifest ({result['path']})")
    for column in ("engine", "target", "status", "built by", "built at", "size"):
        table.add_column(column)
    for entry in result["engines"]:
        status = {"ok": "[green]ok[/green]", "modified": "[red]MODIFIED[/red]"}.get(entry["status"], entry["status"])
        host = entry.get("built_by", {}).get("host", "") if entry.get("built_by") else ""
        table.add_row(entry["name"], entry["target"], status, host, entry.get("built_at", ""),
                      human_bytes(entry.get("bytes")))
    console.print(table)
    counts = result["counts"]
    console.print(", ".join(f"{n} {status}" for status, n in counts.items()))
    modified = [e for e in result["engines"] if e["status"] == "modified"]
    if modified:
        details = "; ".join(f"{e['name']}: {', '.join(e['problems'][:2])}" for e in modified[:3])
        raise BuildError(f"{len(modified)} engine(s) differ from what their build recorded: {details}")
    if sign is not None:
        from ..signing import sign_release_file

        signed = sign_release_file(result["path"], sign)
        console.print(f"signed with key {signed['signature']['key_id'][:16]}… ({result['path']})")


def _verify_signed_manifest(config: Path, out: Path | None, keys: list[Path]) -> None:
    from ..engines_file import load_engines_file
    from ..errors import BuildError
    from ..signing import RELEASE_FILE, verify_workspace

    loaded = load_engines_file(config)
    path = Path(out) if out else Path(loaded.workspace) / RELEASE_FILE
    payload, problems = verify_workspace(path, loaded.workspace, keys)
    if problems:
        raise BuildError(f"{len(problems)} file(s) differ from the signed release {path}: " + "; ".join(problems[:3]))
    console.print(f"{path}: signature verified; {len(payload.get('engines', []))} engine(s) in the workspace "
                  "exactly as signed")


def refit_command(
    config: ConfigArg,
    model: Annotated[str, typer.Option("--model", help="the model whose refittable engines to refit")],
    lora: Annotated[list[str] | None, typer.Option("--lora", help="FILE[:SCALE]; repeat for several")] = None,
    base: Annotated[bool, typer.Option("--base", help="restore the base weights")] = False,
    target: Annotated[str, typer.Option("--target", help=" | ".join(target_names()))] = "onnxruntime",
):
    """Apply LoRAs to refittable engines without a rebuild (or restore the base weights)."""
    from .. import api
    from ..errors import ConfigError

    if not lora and not base:
        raise ConfigError("give --lora FILE[:SCALE] (repeatable) or --base")
    loras = [_parse_lora(text) for text in lora or []]
    results = api.refit(config, model, loras, target=target, base=base)
    table = Table(title=f"refit {model} ({target})")
    for column in ("engine", "weights replaced", "seconds"):
        table.add_column(column)
    for name, count, seconds in results:
        table.add_row(name, str(count), f"{seconds:.2f}")
    console.print(table)


COMMANDS = {"plan": plan_command, "export": export_command, "quantize": quantize_command, "build": build_command,
            "manifest": manifest_command, "refit": refit_command}
