"""argv -> exit code. One place decides what the user sees when something goes wrong:

- exit 0: done;
- exit 1: a user error in a value or a file (`TrtDiffusionError`): one message naming the file, field or value;
- exit 2: a command-line usage error (unknown command or option, a value of the wrong type): click's usage line,
  its did-you-mean and `Try --help`, as click and argparse do;
- exit 3: a bug in trt-diffusion: the traceback and a request to report it;
- exit 130: interrupted.

`--debug` (anywhere on the line) adds the traceback to user errors.
"""

from __future__ import annotations

import sys
import traceback

import typer

from ..errors import TrtDiffusionError
from .app import app, state
from .console import err_console

EXIT_USER_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    state["debug"] = "--debug" in args
    if state["debug"]:
        args = [arg for arg in args if arg != "--debug"]
    command = typer.main.get_command(app)
    try:
        command.main(args=args, prog_name="trt-diffusion", standalone_mode=False)
        return 0
    except TrtDiffusionError as exc:
        if state["debug"]:
            traceback.print_exc()
        from rich.markup import escape  # user text (names, paths) is not markup: "[/bold]x" must print as is

        err_console.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, markup=True,
                          soft_wrap=True)
        return EXIT_USER_ERROR
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        err_console.print("aborted")
        return EXIT_INTERRUPTED
    except typer.TyperException as exc:  # typer's own click: usage errors (exit 2) and its file errors
        exc.show()
        return getattr(exc, "exit_code", EXIT_USAGE)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - a bug in trt-diffusion, not the user's input
        traceback.print_exc()
        err_console.print("[bold red]internal error[/bold red]: this is a bug in trt-diffusion; please report it "
                          "with the traceback above")
        return EXIT_INTERNAL


def entrypoint() -> None:
    """The console script: also prints live progress lines when stderr is not a terminal (CI logs)."""
    from .. import progress

    if progress.plain_lines_wanted():
        progress.show_plain_lines()
    sys.exit(main())
