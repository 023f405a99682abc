"""Options and choices several commands share (one enum per choice, named for what it chooses)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

ConfigArg = Annotated[Path, typer.Argument(help="engines.yaml")]

class Transport(str, Enum):
    """How a client talks to Triton. `--url grpc://HOST:PORT` or `http://…` chooses it too."""

    http = "http"
    grpc = "grpc"
