"""The `trt-diffusion` command line. Each command calls one `api` function and presents its result.

User errors (`TrtDiffusionError`) print one message and exit 1; anything else is a bug: exit 2 with
the traceback. `--debug` shows the traceback for user errors too.
"""

from __future__ import annotations

import json
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.table import Table

from .errors import TrtDiffusionError
from .targets import target_names

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="diffusers models -> verified engines (TensorRT / ONNX Runtime) -> Triton.")
models_app = typer.Typer(no_args_is_help=True, help="Reference model folders.")
app.add_typer(models_app, name="models")

# Logs and CI (no terminal) get a wide console so tables are not squeezed to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
_state = {"debug": False}

ConfigArg = Annotated[Path, typer.Argument(help="engines.yaml")]


class FamilyChoice(str, Enum):
    sd15 = "sd15"
    sdxl = "sdxl"
    sd3 = "sd3"
    flux = "flux"


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="show tracebacks for user errors")] = False):
    _state["debug"] = debug


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


@app.command()
def plan(config: ConfigArg, as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False):
    """Show the engines engines.yaml asks for: how many, why, and their estimated size."""
    from . import api

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
        table.add_row(row.model, row.component, row.target, row.precision, str(row.engines), params,
                      _human_bytes(row.disk_bytes), row.formula + (f"; {row.runs_as}" if row.runs_as else ""))
    console.print(table)
    console.print("batch shapes are the engine's batch: the image batch, doubled where CFG runs batched. "
                  "`--json` lists every engine with its key and reasons.")
    console.print(f"[bold]{result.total_engines} engines[/bold], about {_human_bytes(result.total_disk_bytes)} on disk")


@models_app.command("tiny")
def models_tiny(
    out: Annotated[Path, typer.Option("--out", "-o", help="folder to write")] = Path("models/tiny-sd15"),
    family: Annotated[FamilyChoice, typer.Option("--family")] = FamilyChoice.sd15,
    size: Annotated[str, typer.Option(
        "--size", help="tiny, or full (real UNet architecture, random weights; sd15, sdxl)")] = "tiny",
    seed: int = 0,
    controlnet: Annotated[bool, typer.Option("--controlnet", help="also write a ControlNet in <out>/controlnet")] = False,
    lora: Annotated[bool, typer.Option("--lora", help="also write a LoRA in <out>/lora")] = False,
    overwrite: bool = False,
    if_missing: Annotated[bool, typer.Option("--if-missing", help="do nothing when <out> already exists")] = False,
):
    """Write a seeded reference pipeline folder that DiffusionPipeline.from_pretrained loads."""
    from . import api

    if if_missing and (out / "model_index.json").is_file():
        console.print(f"{out} exists; left as it is")
        return
    path = api.make_tiny_model(out, family.value, seed=seed, size=size, controlnet=controlnet, lora=lora,
                               overwrite=overwrite)
    console.print(f"wrote {family.value} ({size}) model to {path}")


@app.command("export")
def export_command(
    config: ConfigArg,
    model: Annotated[str | None, typer.Option("--model", help="only this model of engines.yaml")] = None,
    component: Annotated[str | None, typer.Option("--component", help="only this component (e.g. unet)")] = None,
):
    """Export the components engines.yaml needs to ONNX, each verified against PyTorch (cached when unchanged)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from . import api

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


@app.command("quantize")
def quantize_command(
    config: ConfigArg,
    model: Annotated[str | None, typer.Option("--model")] = None,
    force: Annotated[bool, typer.Option("--force", help="recalibrate and re-export even when cached")] = False,
):
    """ModelOpt FP8/INT8 for the fp8/int8 entries: seeded calibration, Q/DQ ONNX, quality gate."""
    from . import api

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


@app.command("build")
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

    from . import api
    from .errors import BuildError, InternalError

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    from .progress import task as progress_lines

    with Progress(*columns, console=err_console, transient=True) as progress, \
            progress_lines("build", detail="exports, then one engine per shape") as lines:
        task = progress.add_task("build", total=None)
        finished = []

        def on_engine(status, spec) -> None:  # from the build threads when --jobs > 1
            progress.advance(task)
            progress.update(task, description=f"{spec.name}: {status}")
            finished.append(spec.name)
            lines.step(detail=f"{len(finished)} engines finished, last {spec.name}: {status}", force=True)

        from .targets.shards import parse_shard

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
    if report.internal_failures:  # a bug, not bad input: show where it happened and exit 2
        for outcome in report.internal_failures:
            err_console.print(outcome.failure.traceback, highlight=False, markup=False, soft_wrap=True)
        names = ", ".join(o.spec.name for o in report.internal_failures)
        raise InternalError(f"{len(report.internal_failures)} engine(s) failed with an internal error: {names}")
    if report.failed:
        names = ", ".join(o.spec.name for o in report.failed)
        raise BuildError(f"{len(report.failed)} engine(s) failed to build: {names}")


@app.command("parity")
def parity_command(
    config: ConfigArg,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="a text file, one prompt a line")] = None,
    seeds: Annotated[list[int] | None, typer.Option("--seeds", help="repeat for several seeds")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, max=200)] = 4,
    out: Annotated[Path | None, typer.Option("--out", help="report folder (default <workspace>/reports/parity)")] = None,
    target: Annotated[list[str] | None, typer.Option("--target")] = None,
):
    """Compare every built engine variant's images with the PyTorch reference; fails when a gate fails."""
    from . import api
    from .errors import ParityError
    from .parity.report import render_summary

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


def _parse_lora(text: str) -> tuple[Path, float]:
    path, _, scale = text.rpartition(":") if ":" in text else (text, "", "1.0")
    try:
        return Path(path), float(scale)
    except ValueError:
        raise typer.BadParameter(f"--lora {text!r}: expected FILE or FILE:SCALE (e.g. style.safetensors:0.8)")


@app.command("manifest")
def manifest_command(
    config: ConfigArg,
    out: Annotated[Path | None, typer.Option("--out", help="where to write it (default "
                                                "<workspace>/release-manifest.json)")] = None,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="check every file's sha256")] = True,
):
    """The release manifest of every engine (provenance + sha256), verified; exit 1 if a file changed."""
    from . import api
    from .errors import BuildError

    result = api.manifest(config, verify=verify, out=out)
    table = Table(title=f"release manifest ({result['path']})")
    for column in ("engine", "target", "status", "built by", "built at", "size"):
        table.add_column(column)
    for entry in result["engines"]:
        status = {"ok": "[green]ok[/green]", "modified": "[red]MODIFIED[/red]"}.get(entry["status"], entry["status"])
        host = entry.get("built_by", {}).get("host", "") if entry.get("built_by") else ""
        table.add_row(entry["name"], entry["target"], status, host, entry.get("built_at", ""),
                      _human_bytes(entry.get("bytes")))
    console.print(table)
    counts = result["counts"]
    console.print(", ".join(f"{n} {status}" for status, n in counts.items()))
    modified = [e for e in result["engines"] if e["status"] == "modified"]
    if modified:
        details = "; ".join(f"{e['name']}: {', '.join(e['problems'][:2])}" for e in modified[:3])
        raise BuildError(f"{len(modified)} engine(s) differ from what their build recorded: {details}")


@app.command("refit")
def refit_command(
    config: ConfigArg,
    model: Annotated[str, typer.Option("--model", help="the model whose refittable engines to refit")],
    lora: Annotated[list[str] | None, typer.Option("--lora", help="FILE[:SCALE]; repeat for several")] = None,
    base: Annotated[bool, typer.Option("--base", help="restore the base weights")] = False,
    target: Annotated[str, typer.Option("--target", help=" | ".join(target_names()))] = "onnxruntime",
):
    """Apply LoRAs to refittable engines without a rebuild (or restore the base weights)."""
    from . import api
    from .errors import ConfigError

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


def _register_triton_commands() -> None:
    from .triton.commands import generate_command, package_command, serve_command

    app.command("package")(package_command)
    app.command("serve")(serve_command)
    app.command("generate")(generate_command)


_register_triton_commands()


def _register_preflight_command() -> None:
    from .preflight.command import preflight_command

    app.command("preflight")(preflight_command)


_register_preflight_command()


def main(argv: list[str] | None = None) -> int:
    command = typer.main.get_command(app)
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        command.main(args=args, prog_name="trt-diffusion", standalone_mode=False)
        return 0
    except TrtDiffusionError as exc:
        if debug:
            traceback.print_exc()
        from rich.markup import escape  # user text (names, paths) is not markup: "[/bold]x" must print as is

        err_console.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, markup=True,
                          soft_wrap=True)
        return 1
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        err_console.print("aborted")
        return 130
    except click.ClickException as exc:
        exc.show()
        return 1 if isinstance(exc, click.UsageError) else exc.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except Exception:  # a bug in trt-diffusion, not the user's input
        traceback.print_exc()
        err_console.print("[bold red]internal error[/bold red]: this is a bug in trt-diffusion; please report it "
                          "with the traceback above")
        return 2


def entrypoint() -> None:
    """The console script: also prints live progress lines when stderr is not a terminal (CI logs)."""
    from . import progress

    if progress.plain_lines_wanted():
        progress.show_plain_lines()
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
