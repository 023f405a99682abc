"""`trt-diffusion keys`: the ed25519 key pair that signs releases (docs/security.md, signing.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .console import console


def generate_command(
    private: Annotated[Path, typer.Argument(help="private key PEM to write (mode 0600; never overwritten)")],
    public: Annotated[Path | None, typer.Option("--public", help="public key PEM to write "
                                                "(default: PRIVATE's stem + .pub.pem)")] = None,
):
    """Write a new key pair: the private key stays on the release host (manifest --sign); packaging and serving
    hosts get the public key (package/serve --verify)."""
    from ..signing import generate_keys

    private_path, public_path, key_id = generate_keys(private, public)
    console.print(f"private key  {private_path}  (keep it on the release host)")
    console.print(f"public key   {public_path}")
    console.print(f"key id       {key_id}")


COMMANDS = {"generate": generate_command}
