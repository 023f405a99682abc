"""The consoles every command prints through.

On a terminal rich wraps to its width. Anywhere else (a CI log, a pipe, a file) nothing is cut or wrapped:
engine names and suggested commands must stay copyable, so the width is practically unbounded.
"""

from __future__ import annotations

import sys

from rich.console import Console

UNBOUNDED_WIDTH = 10_000


def _width(stream) -> int | None:
    try:
        return None if stream.isatty() else UNBOUNDED_WIDTH
    except (AttributeError, ValueError):
        return UNBOUNDED_WIDTH


# file=None: rich writes to the sys.stdout/sys.stderr of the moment (pytest and CliRunner swap them).
console = Console(width=_width(sys.stdout))
err_console = Console(stderr=True, width=_width(sys.stderr))


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
