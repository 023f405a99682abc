"""`openai-api`: the OpenAI-compatible Images API in front of a Triton serving trt-diffusion entries (its own
host, or beside `serve`, which starts the same API with --openai-port)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .console import console

DEFAULT_MAX_BODY = 16 * 1024 * 1024  # openai_api.settings.DEFAULT_MAX_BODY_BYTES (not imported: keeps --help fast)

ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="TRT_DIFFUSION_API_KEY", help="require `Authorization: Bearer KEY` (401 without); "
    "prefer the environment variable to the command line")]
MaxBody = Annotated[int, typer.Option("--max-body-bytes", min=1024, help="request bodies beyond this are refused "
                                      "(413)")]
AllowedHosts = Annotated[list[str] | None, typer.Option(
    "--allowed-hosts", help="a Host name clients may call the API by, besides the address it listens on, localhost, "
    "127.0.0.1 and [::1] (repeatable or comma-separated); any other Host is refused (403: DNS rebinding, "
    "docs/security.md)")]
CorsOrigins = Annotated[list[str] | None, typer.Option(
    "--cors-origin", help="a web origin whose pages may call the API, as browsers send it (https://app.example.com; "
    "repeatable or comma-separated); a request from any other Origin is refused (403)")]
StateDir = Annotated[Path | None, typer.Option(
    "--state-dir", help="the job store's folder (batches: their files, results and SQLite records); default "
    "$XDG_STATE_HOME/trt-diffusion, else ~/.local/state/trt-diffusion (docs/deploy.md)")]
StateMaxGb = Annotated[float, typer.Option("--state-max-gb", min=0.001, help="the job store's disk quota: an upload "
                                           "or result that does not fit is refused (413)")]
DEFAULT_STATE_MAX_GB = 10.0  # openai_api.settings.DEFAULT_STATE_MAX_BYTES in GiB
JobTimeout = Annotated[float, typer.Option(
    "--job-timeout", help="seconds a job's call to Triton (a batch line, a video) may take, queue and pauses for "
    "people included (online requests get 600); default 86400, a batch's completion window (docs/deploy.md)")]
DEFAULT_JOB_TIMEOUT_S = 86400.0  # openai_api.settings.DEFAULT_JOB_TIMEOUT_S
ServingConfig = Annotated[Path | None, typer.Option(
    "--config", help="engines.yaml: its models' `serving: overload:` policies (degrade, then refuse, past an "
    "estimated wait; docs/deploy.md) apply to online requests; without it no request is degraded or refused for "
    "load")]


def overload_options(config: Path | None) -> dict:
    """The ApiSettings field of --config: engines.yaml's overload policies, checked before anything starts. The
    model sources need not be on this host (the API serves what Triton loaded)."""
    if config is None:
        return {}
    from ..engines_file import load_engines_file
    from ..openai_api.overload import describe, policies_from_config

    policies = policies_from_config(load_engines_file(config, check_sources=False))
    for model, policy in policies:
        console.print(f"overload policy  {model}: {describe(policy)}", highlight=False)
    if not policies:
        console.print(f"[yellow]note:[/yellow] {config} sets no `serving: overload:`: no request is degraded or "
                      "refused for load", highlight=False)
    return {"overload": policies}


def state_options(state_dir: Path | None, state_max_gb: float) -> dict:
    """The ApiSettings fields of --state-dir / --state-max-gb (the folder defaults under the user's state folder)."""
    from ..openai_api.job_store import default_state_dir

    return {"state_dir": state_dir if state_dir is not None else default_state_dir(),
            "state_max_bytes": int(state_max_gb * 1024**3)}


def names(values: list[str] | None) -> tuple[str, ...]:
    """--allowed-hosts / --cors-origin values: each option may hold several, comma-separated."""
    return tuple(name.strip() for value in values or () for name in value.split(",") if name.strip())


def openai_api_command(
    triton_urls: Annotated[list[str] | None, typer.Option(
        "--triton-url", help="Triton's gRPC address (grpc://HOST:8001); several (repeatable or comma-separated): "
        "replicas of one model repository, each request sent to a ready one with the least load (its Triton queue "
        "when --triton-metrics-url is given, plus this API's calls in flight), retried once on another when its "
        "replica is unavailable (docs/deploy.md, N hosts)")] = None,
    triton_metrics_urls: Annotated[list[str] | None, typer.Option(
        "--triton-metrics-url", help="each replica's Triton metrics, HOST[:PORT] (port 8002, path /metrics by "
        "default) or http://HOST:PORT/metrics: repeatable or comma-separated, one per --triton-url in the same "
        "order; their queues (nv_inference_pending_request_count) are read every second to route by. Without it, "
        "replicas are loaded by this API's own calls in flight")] = None,
    host: Annotated[str, typer.Option("--host", help="address to listen on (loopback by default; docs/security.md "
                                      "before exposing it)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8080,
    api_key: ApiKey = None,
    max_body_bytes: MaxBody = DEFAULT_MAX_BODY,
    allowed_hosts: AllowedHosts = None,
    cors_origins: CorsOrigins = None,
    state_dir: StateDir = None,
    state_max_gb: StateMaxGb = DEFAULT_STATE_MAX_GB,
    job_timeout_s: JobTimeout = DEFAULT_JOB_TIMEOUT_S,
    config: ServingConfig = None,
):
    """Serve the OpenAI Images API (/v1/images/generations, /v1/images/edits, /v1/models, and batches: /v1/files,
    /v1/batches) in front of Triton."""
    from .. import api
    from ..openai_api.settings import ApiSettings

    triton_url = ",".join(names(triton_urls)) if triton_urls else "grpc://127.0.0.1:8001"
    settings = ApiSettings(triton_url, triton_metrics_urls=names(triton_metrics_urls), host=host, port=port,
                           api_key=api_key, max_body_bytes=max_body_bytes, allowed_hosts=names(allowed_hosts),
                           cors_origins=names(cors_origins), job_timeout_s=job_timeout_s,
                           **state_options(state_dir, state_max_gb), **overload_options(config)).check()
    metrics = f", metrics {', '.join(settings.replica_metrics_urls())}" if settings.triton_metrics_urls else ""
    console.print(f"OpenAI API  http://{host}:{port}/v1  (Triton {', '.join(settings.triton_urls())}{metrics}; "
                  "Ctrl-C stops it)", highlight=False)
    if host in ("0.0.0.0", "::") and not settings.allowed_hosts:  # every interface, but only loopback's names
        console.print(f"[yellow]note:[/yellow] --host {host}: requests must name this server as localhost or "
                      "127.0.0.1 (403 otherwise); list the names other clients use with --allowed-hosts",
                      highlight=False)
    api.openai_api(settings)


COMMANDS = {"openai-api": openai_api_command}
