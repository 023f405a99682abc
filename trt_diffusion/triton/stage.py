"""The package and serve stages: engines.yaml -> Triton repository -> a running server.

`serve` checks the repository, starts the server, waits until every model is ready (warm-up included, via
strict readiness), then sends one request per bucket and records its latency: the first-request latency
a user would see, in a WarmupReport.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import signing
from ..engines_file.engine_spec import Size
from ..errors import ServeError
from . import memory_budget, naming
from .release_check import verify_engine_models
from .report import PackageReport
from .repository import PackageOptions, PipelineSource, package_models
from .sealed_repository import seal_repository, verified_copy
from .server import ServerPorts, TritonServer, free_port
from .signals import stop_signals_interrupt
from .supervise import supervise
from .validate import validate_repository

# Our configs are complete: skip the python backend's auto-complete pass, which starts one extra stub per model.
SERVER_ARGS = ["--disable-auto-complete-config"]
WARMUP_REPORT = "warmup_report.json"

# The first request after start is timed at a typical step count: what a user's first image costs.
FIRST_REQUEST_STEPS = 20


def package_stage(config_path: str | Path, out_dir: str | Path = "triton_repo", target: str = "onnxruntime", *,
                  model: str | Sequence[str] | None = None, options: PackageOptions | None = None,
                  lora_variant: str | None = None, verify_keys: Sequence[str | Path] = (),
                  release: str | Path | None = None, all_models: bool = False,
                  memory_budget_gb: float | None = None, sign_key: str | Path | None = None) -> PackageReport:
    """Package the built engines of one model of engines.yaml — or several (`model` a list, or `all_models`) into
    one repository, an entry per model — as a Triton repository.

    `memory_budget_gb` (default engines.yaml's `preflight: memory: max_rss_gb`): the models' estimated memory once served
    must fit it (triton/memory_budget.py). `verify_keys` (public keys; several for rotation), required when
    engines.yaml says `build.trust: signed`: every engine must be exactly what the signed release manifest
    (`release`, default <workspace>/release-manifest.json) lists; the verified release is copied into the
    repository for serve. `sign_key` (the release host's private key; needs `verify_keys`): sign every file of
    the repository once it is written (sealed_repository.py), which `serve --verify` requires."""
    from ..engines_file import load_engines_file
    from ..runtime.loader import built_engines

    config = load_engines_file(config_path, check_sources=True)
    names = _chosen_models(config, model, all_models)
    release_path = Path(release) if release else Path(config.workspace) / signing.RELEASE_FILE
    if config.build.trust == "signed" and not verify_keys:
        raise signing.SignatureError(f"{config.path}: build.trust is signed: give the release's public key with "
                                     "--verify PUBKEY")
    if config.build.trust == "signed" and sign_key is None:  # its repository is served only with --verify
        raise signing.SignatureError(f"{config.path}: build.trust is signed: serve --verify serves only a signed "
                                     "repository; package on the release host with --sign KEY too")
    if sign_key is not None and not verify_keys:
        raise signing.SignatureError("--sign seals a repository of verified engines only: give the release's public "
                                     "key with --verify PUBKEY too")
    if sign_key is not None:
        signing.load_private_key(sign_key)  # a wrong key fails now, not after the whole package
    # LoRA per request: engines.yaml's refit LoRAs, split into each refittable engine's part (issue 28)
    from .lora_parts import served_lora_names, write_parts

    Path(out_dir).resolve().parent.mkdir(parents=True, exist_ok=True)
    signed = bool(verify_keys) or config.build.trust == "signed"
    budget = memory_budget_gb if memory_budget_gb is not None else config.preflight.memory.max_rss_gb
    with tempfile.TemporaryDirectory(prefix=".lora-parts-", dir=Path(out_dir).resolve().parent) as parts_dir:
        sources = []
        for name in names:
            engines = built_engines(config, name, target, lora_variant=lora_variant)
            if verify_keys:
                signing.verify_engines(engines, config.workspace, release_path, verify_keys)
            resolved = config.models[name]
            served = served_lora_names(resolved)
            notes = ["LoRAs are not served per request from a signed release (their parts are not in it): LORAS "
                     "naming one is refused"] if signed and served else []
            parts = {} if signed else write_parts(config, name, engines, Path(parts_dir) / naming.sanitize(name))
            sources.append(PipelineSource(engines, resolved.source.path, resolved.family, name,
                                          workflows=resolved.workflows, cfg=resolved.cfg,  # engines.yaml's own
                                          loras=parts, served_loras=served if parts else (), notes=notes,
                                          step_cache=resolved.step_cache))
        report = package_models(sources, out_dir, options, memory_budget_gb=budget)
    if verify_keys:
        shutil.copyfile(release_path, Path(out_dir) / signing.RELEASE_FILE)  # serve --verify checks it again
    if config.build.trust == "signed":  # serve then requires --verify too
        (Path(out_dir) / TRUST_FILE).write_text(json.dumps({"trust": "signed"}) + "\n")
    if sign_key is not None:  # last: the seal covers every file written above
        seal_repository(out_dir, sign_key)
    return report


def _chosen_models(config, model: str | Sequence[str] | None, all_models: bool) -> list[str]:
    """The models to package: those named (each must exist), every one with `all_models`, else the only one."""
    if all_models:
        if model:
            raise ServeError("give --model or --all-models, not both")
        return list(config.models)
    names = [model] if isinstance(model, str) else list(model or ())
    if not names:
        if len(config.models) != 1:
            raise ServeError(f"{config.path} has {len(config.models)} models ({', '.join(config.models)}); "
                             "choose with --model (repeatable) or --all-models")
        return list(config.models)
    unknown = [name for name in names if name not in config.models]
    if unknown:
        raise ServeError(f"{config.path} has no model {', '.join(map(repr, unknown))}; its models: "
                         f"{', '.join(config.models)}")
    if len(set(names)) != len(names):
        raise ServeError(f"--model names a model twice: {', '.join(names)}")
    return names


TRUST_FILE = "trust.json"  # beside the models: what the workspace required when it was packaged


@dataclass
class FirstRequest:
    size: str
    seconds: float
    protocol: str


@dataclass
class WarmupReport:
    repo: str
    http_url: str
    grpc_url: str
    seconds_to_ready: float  # start to ready: every model loaded and its warm-up done
    models_ready: dict[str, bool]
    first_requests: list[FirstRequest] = field(default_factory=list)
    log: str = ""
    metrics_url: str = ""  # Triton's Prometheus endpoint (http://127.0.0.1:PORT/metrics); "" with triton_http off

    @property
    def all_ready(self) -> bool:
        return all(self.models_ready.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        # as tritonserver binds: a port left in TIME_WAIT by the last run is free, one with a listener is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(http_port: int | None, grpc_port: int | None, metrics_port: int | None) -> ServerPorts:
    chosen = ServerPorts(http_port or free_port(), grpc_port or free_port(), metrics_port or free_port())
    busy = [f"{name} port {port}" for name, port in asdict(chosen).items() if not port_is_free(port)]
    if busy:
        raise ServeError(f"{', '.join(busy)} already in use on 127.0.0.1; choose other ports "
                         "(--http-port / --grpc-port / --metrics-port)")
    return chosen


def start(repo: str | Path, *, http_port: int | None = None, grpc_port: int | None = None,
          metrics_port: int | None = None, work_dir: str | Path | None = None, ready_timeout_s: float = 900.0,
          first_request: bool = True, protocol: str = "grpc",
          admin_apis: bool = False, verify_keys: Sequence[str | Path] = (),
          memory_budget_gb: float | None = None,
          after_verify: Callable[[], None] | None = None,
          triton_http: bool = True) -> tuple[TritonServer, WarmupReport]:
    """Start a server on `repo` (bound to 127.0.0.1) and wait until it is ready and warm.

    `admin_apis`: leave Triton's shared-memory, trace and logging APIs open to every client
    (closed by default: see server.py). `verify_keys`: the repository must be signed (`package --sign`); its
    files are copied into a private folder of the work folder, every byte checked against the signature, and the
    server runs on that copy, so a change to `repo` after the check is never served (sealed_repository.py).
    `after_verify` is a test seam: called once the copy is verified, before anything reads it.
    `memory_budget_gb`: the models' estimated memory recorded by `package` must fit this host's budget.
    `triton_http=False`: no HTTP and no metrics port, gRPC only (what the OpenAI API talks to; docs/security.md)."""
    repo = Path(repo).resolve()
    if (repo / TRUST_FILE).is_file() and not verify_keys:
        raise signing.SignatureError(f"{repo} was packaged from a workspace with build.trust: signed; serve it "
                                     "with --verify PUBKEY")
    temporary = work_dir is None  # a folder made here is removed when the server stops (or fails to start)
    work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="trt-diffusion-serve-"))
    try:
        if verify_keys:  # from here on `repo` is the verified private copy: nothing reads the original again
            repo = verified_copy(repo, verify_keys, work_dir)
            verify_engine_models(repo, verify_keys)
            if after_verify is not None:
                after_verify()
        return _start_checked(repo, work_dir, temporary, (http_port, grpc_port, metrics_port), ready_timeout_s,
                              first_request, protocol, admin_apis, memory_budget_gb, triton_http)
    except BaseException:
        if temporary:
            shutil.rmtree(work_dir, ignore_errors=True)
        raise


def _start_checked(repo: Path, work_dir: Path, temporary: bool, ports: tuple[int | None, int | None, int | None],
                   ready_timeout_s: float, first_request: bool, protocol: str, admin_apis: bool,
                   memory_budget_gb: float | None, triton_http: bool = True) -> tuple[TritonServer, WarmupReport]:
    report = PackageReport.read(repo)
    if memory_budget_gb is not None:  # this host's budget, against what `package` estimated
        memory_budget.check([memory_budget.MemoryShare(**share) for share in report.memory], memory_budget_gb)
    validate_repository(repo)  # hand edits since `package` fail here, with names, not in the server's log
    server, seconds = start_server(repo, work_dir, ports, ready_timeout_s, admin_apis, http=triton_http)
    server.remove_work_dir = temporary
    try:
        warmup = WarmupReport(str(repo), server.http_url if triton_http else "", server.grpc_url, seconds, models_ready(server, report),
                              log=str(server.log_path),
                              metrics_url=f"http://127.0.0.1:{server.ports.metrics}/metrics" if triton_http else "")
        if not warmup.all_ready:
            raise ServeError(f"models not ready after the server said ready: "
                             f"{[n for n, ok in warmup.models_ready.items() if not ok]}\n{server.log_tail()}")
        if first_request:
            warmup.first_requests = first_requests(server, report, protocol)
        (work_dir / WARMUP_REPORT).write_text(warmup.to_json())
    except BaseException:
        server.stop()
        raise
    return server, warmup


# free_port() finds a port and frees it again before tritonserver binds it: another process may take it in between.
PORT_ATTEMPTS = 4


def start_server(repo: Path, work_dir: Path, wanted: tuple[int | None, int | None, int | None],
                  ready_timeout_s: float, admin_apis: bool, http: bool = True) -> tuple[TritonServer, float]:
    """Start on the wanted ports, picking free ones for those not given; when tritonserver finds a port it was
    given by us already taken, pick again (a port the user chose and lost is their error, reported as is)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        server = TritonServer(repo, work_dir, ports=_ports(*wanted), extra_args=SERVER_ARGS, admin_apis=admin_apis,
                              http=http)
        try:
            return server, server.start(timeout_s=ready_timeout_s)
        except ServeError as err:
            picked = [port for port, want in zip(asdict(server.ports).values(), wanted) if want is None]
            if attempt == PORT_ATTEMPTS or not any(f":{port}' already in use" in str(err) for port in picked):
                raise
    raise AssertionError("unreachable")


def models_ready(server: TritonServer, report: PackageReport) -> dict[str, bool]:
    return server.models_ready([model.name for model in report.models])


def first_requests(server: TritonServer, report: PackageReport, protocol: str = "grpc") -> list[FirstRequest]:
    """One small request per bucket through the public entry, timed: the latency of a first request. It asks for
    the model's natural workflow (an image-to-video model serves img2vid alone: its request carries a seeded first
    frame at the bucket's size)."""
    from ..sample_inputs import cfg_fields, natural_workflow, request_fields
    from .client import ImageRequest, client_module, connect, infer

    module = client_module(protocol)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    client = connect(url, protocol)
    records = []
    try:
        client.is_server_ready()  # opens the connection: its setup is the client's cost, not the server's
        for pipeline in report.all_pipelines():  # a repository of several models: each model's buckets
            workflow = natural_workflow(pipeline.workflows)
            for label in pipeline.request_sizes:
                size = Size.parse(label)
                # with the family's CFG as users run it (Qwen-Image: an empty negative prompt, or its true CFG off)
                request = ImageRequest("warm-up request", size.height, size.width, steps=FIRST_REQUEST_STEPS,
                                       seed=0, frames=size.frames or None, **cfg_fields(pipeline.family),
                                       **request_fields(workflow, size.height, size.width))
                start_time = time.perf_counter()
                infer(client, module, pipeline.entry, request, protocol=protocol, timeout_s=600.0, url=url)
                label = label if len(report.all_pipelines()) == 1 else f"{pipeline.entry} {label}"
                records.append(FirstRequest(label, time.perf_counter() - start_time, protocol))
    finally:
        client.close()
    return records


def check_replicas(replicas: int) -> None:
    if replicas < 1:
        raise ServeError(f"--replicas must be at least 1 (the tritonservers to start on this host), got {replicas}")


def serve(repo: str | Path, *, http_port: int | None = 8000, grpc_port: int | None = 8001,
          metrics_port: int | None = 8002, work_dir: str | Path | None = None, first_request: bool = True,
          ready_timeout_s: float = 900.0, on_ready: Callable[[WarmupReport], None] | None = None,
          admin_apis: bool = False, verify_keys: Sequence[str | Path] = (),
          memory_budget_gb: float | None = None, triton_http: bool = True,
          replicas: int = 1) -> WarmupReport | list[WarmupReport] | None:
    """Start, report, then block until Ctrl-C / SIGTERM, and stop cleanly.

    A stop while starting, while the first requests are timed or while serving stops tritonserver and its stubs
    and removes the temporary work folder; it returns None when the server was stopped before it was ready.

    `replicas` > 1: that many tritonservers over the same repository on this host (the OpenAI API's replicas, tests,
    a big host), started one after the other: the first on the ports given, each other on free ports of its own,
    each its own work folder; `on_ready` gets, and the call returns, their reports in order. One failing to start
    stops those started (ServeError naming it, its log tail); one exiting later is started again on its ports
    (supervise.py), and one that keeps failing quickly stops all (ServeError naming it). `memory_budget_gb` is
    the host's: each replica's estimated memory must fit its share (budget / replicas)."""
    from .server import LIVE_SERVERS

    check_replicas(replicas)
    # SIGTERM (systemd, docker stop) stops as Ctrl-C does, from the first moment: with Python's default SIGTERM
    # the process would end without stopping the server it started. (Handlers need the main thread.)
    with stop_signals_interrupt():
        already = set(LIVE_SERVERS)
        servers, warmups = [], []
        try:
            for index in range(replicas):
                ports = (http_port, grpc_port, metrics_port) if index == 0 else (None, None, None)
                try:
                    server, warmup = start(repo, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                                           work_dir=work_dir if replicas == 1 else None,
                                           ready_timeout_s=ready_timeout_s, first_request=first_request,
                                           admin_apis=admin_apis, verify_keys=verify_keys,
                                           memory_budget_gb=None if memory_budget_gb is None
                                           else memory_budget_gb / replicas, triton_http=triton_http)
                except ServeError as err:
                    if replicas == 1:
                        raise
                    raise ServeError(f"replica {index + 1} of {replicas} did not start (the others are stopped): "
                                     f"{err}") from None
                servers.append(server)
                warmups.append(warmup)
            if on_ready:
                on_ready(warmups[0] if replicas == 1 else list(warmups))
            if replicas > 1:  # a replica that exits is started again (supervise.py); raises when one is given up
                supervise(servers, ready_timeout_s)
            while servers[0].is_alive():
                time.sleep(0.5)
            raise ServeError(f"tritonserver exited unexpectedly with {servers[0].process.returncode}:\n"
                             f"{servers[0].log_tail()}")
        except KeyboardInterrupt:
            pass
        finally:
            # whatever this call started, wherever the stop came; a replica whose restart failed is no longer live
            # but keeps its work folder until stopped
            for server in [s for s in servers if id(s) not in LIVE_SERVERS] + \
                    [LIVE_SERVERS[key] for key in set(LIVE_SERVERS) - already]:
                server.stop()
    if len(warmups) < replicas:
        return None
    return warmups[0] if replicas == 1 else warmups
