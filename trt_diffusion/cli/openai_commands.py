"""`openai-api`: the OpenAI-compatible Images API in front of a Triton serving trt-diffusion entries (its own
host, or beside `serve`, which starts the same API with --openai-port)."""

from __future__ import annotations

from typing import Annotated

import typer

from .console import console

DEFAULT_MAX_BODY = 16 * 1024 * 1024  # openai_api.settings.DEFAULT_MAX_BODY_BYTES (not imported: keeps --help fast)

ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="TRT_DIFFUSION_API_KEY", help="require `Authorization: Bearer KEY` (401 without); "
    "prefer the environment variable to the command line")]
MaxBody = Annotated[int, typer.Option("--max-body-bytes", min=1024, help="request bodies beyond this are refused "
                                      "(413)")]


def openai_api_command(
    triton_url: Annotated[str, typer.Option("--triton-url", help="Triton's gRPC address (grpc://HOST:8001)")]
    = "grpc://127.0.0.1:8001",
    host: Annotated[str, typer.Option("--host", help="address to listen on (loopback by default; docs/security.md "
                                      "before exposing it)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8080,
    api_key: ApiKey = None,
    max_body_bytes: MaxBody = DEFAULT_MAX_BODY,
):
    """Serve the OpenAI Images API (/v1/images/generations, /v1/images/edits, /v1/models) in front of Triton."""
    from .. import api
    from ..openai_api.settings import ApiSettings

    settings = ApiSettings(triton_url, host=host, port=port, api_key=api_key, max_body_bytes=max_body_bytes).check()
    console.print(f"OpenAI API  http://{host}:{port}/v1  (Triton {triton_url}; Ctrl-C stops it)", highlight=False)
    api.openai_api(settings)


COMMANDS = {"openai-api": openai_api_command}
