"""The `trt-diffusion` command line: the typer app (`app.py`), exit codes (`main.py`), shared options and
consoles, and one module per command group. Nothing below this package imports typer or rich's console."""

from .app import app
from .console import console, err_console
from .main import EXIT_INTERNAL, EXIT_USAGE, EXIT_USER_ERROR, entrypoint, main

__all__ = ["EXIT_INTERNAL", "EXIT_USAGE", "EXIT_USER_ERROR", "app", "console", "entrypoint", "err_console", "main"]
