"""The `trt-diffusion` command line. Each command calls one `api` function and presents its result.

User errors (`TrtDiffusionError`) print one message and exit 1; anything else is a bug: exit 2 with
the traceback. `--debug` shows the traceback for user errors too.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.console import Console
from rich.table import Table

from .errors import TrtDiffusionError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="diffusers models -> verified engines (TensorRT / ONNX Runtime) -> Triton.")
models_app = typer.Typer(no_args_is_help=True, help="Reference model folders.")
app.add_typer(models_app, name="models")

console = Console()
err_console = Console(stderr=True)
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
                      _human_bytes(row.disk_bytes), row.formula)
    console.print(table)
    console.print("batch shapes are the engine's batch: the image batch, doubled where CFG runs batched. "
                  "`--json` lists every engine with its key and reasons.")
    console.print(f"[bold]{result.total_engines} engines[/bold], about {_human_bytes(result.total_disk_bytes)} on disk")


@models_app.command("tiny")
def models_tiny(
    out: Annotated[Path, typer.Option("--out", "-o", help="folder to write")] = Path("models/tiny-sd15"),
    family: Annotated[FamilyChoice, typer.Option("--family")] = FamilyChoice.sd15,
    size: Annotated[str, typer.Option("--size", help="tiny, or full (real architecture, random weights; sd15)")] = "tiny",
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
        err_console.print(f"[bold red]error:[/bold red] {exc}", highlight=False, markup=True, soft_wrap=True)
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
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
