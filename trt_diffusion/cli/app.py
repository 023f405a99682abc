"""The typer app: the top-level options (`--debug`, `--version`) and every command group, registered once.

Each command module holds typer-annotated functions that call one `api` function and present its result;
`main.py` maps what they raise to exit codes.
"""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="diffusers models -> verified engines (TensorRT / ONNX Runtime / OpenVINO) -> Triton.")
models_app = typer.Typer(no_args_is_help=True, help="Reference model folders.")
app.add_typer(models_app, name="models")
keys_app = typer.Typer(no_args_is_help=True, help="Release signing keys (ed25519; docs/security.md).")
app.add_typer(keys_app, name="keys")

# What main() found on the command line before typer parsed it (--debug may stand anywhere).
state = {"debug": False}


def _show_version(value: bool) -> None:
    if value:
        from .versions import version_lines

        for line in version_lines():
            typer.echo(line)
        raise typer.Exit()


@app.callback()
def _top_level(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks for user errors (anywhere on the line)")]
    = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version,
                                          help="the versions of trt-diffusion and the engines it drives")] = False,
):
    state["debug"] = state["debug"] or debug


def _register_commands() -> None:
    from . import build_commands, keys_commands, models_commands, openai_commands, report_commands, serve_commands

    for module in (build_commands, report_commands, serve_commands, openai_commands):
        for name, function in module.COMMANDS.items():
            app.command(name)(function)
    for name, function in models_commands.COMMANDS.items():
        models_app.command(name)(function)
    for name, function in keys_commands.COMMANDS.items():
        keys_app.command(name)(function)


_register_commands()
