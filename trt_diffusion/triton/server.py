"""Start and stop a `tritonserver` bound to 127.0.0.1.

A system `tritonserver` on PATH is used when present (NVIDIA's containers: all backends). Otherwise the
binary bundled in `nvidia-pytriton` runs, whose only backend is python (docs/triton.md): its backend
folder is copied to a work folder with the python stub of this interpreter, and the stub finds this
interpreter through PATH, so the venv's bin goes first.

`http=False` starts it without its HTTP and metrics ports (`--allow-http=false`): gRPC only, what the OpenAI API talks to. A
web page can send requests to a loopback HTTP port (docs/security.md, "Browsers and the API"); it cannot speak
gRPC, which needs HTTP/2 with trailers that browsers do not expose.

Triton's administrative APIs (shared memory, trace and log settings) are closed unless asked
for (`admin_apis=True`): they need a header whose value is a random key made at each start. Any local client
could otherwise register shared memory, turn on tracing into files or change the log settings.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ServeError
from .signals import deferred_stop_signals

# Triton's API groups a client needs the admin header for (`--http-restricted-api` / `--grpc-restricted-protocol`).
# model-repository stays open: `generate` finds the pipeline through the index, and load/unload are refused
# anyway (the server runs without --model-control-mode=explicit).
RESTRICTED_APIS = ("shared-memory", "trace", "logging")
ADMIN_HEADER = "trt-diffusion-admin"


@dataclass
class ServerPorts:
    http: int
    grpc: int
    metrics: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bundled_server(work_dir: Path) -> tuple[Path, Path, dict[str, str]]:
    try:
        import pytriton
    except ImportError:
        raise ServeError("no tritonserver on PATH and nvidia-pytriton is not installed") from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not binary.is_file() or not stub.is_file():
        raise ServeError(f"the bundled tritonserver or its python {version} stub is missing under {root}")
    backends = work_dir / "backends"
    if not (backends / "python" / "triton_python_backend_stub").is_file():
        shutil.rmtree(backends, ignore_errors=True)
        shutil.copytree(root / "backends", backends)
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(libs), sysconfig.get_config_var("LIBDIR"),
                                                         os.environ.get("LD_LIBRARY_PATH")])),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    return binary, backends, env


def tensorrt_args(repo: Path) -> list[str]:
    """`--backend-config=tensorrt,version-compatible=true` when a packaged plan was built version-compatible."""
    from ..targets.tensorrt.triton_args import tritonserver_args

    return tritonserver_args(repo)


@dataclass
class TritonServer:
    repo: Path
    work_dir: Path
    ports: ServerPorts = field(default_factory=lambda: ServerPorts(free_port(), free_port(), free_port()))
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    admin_apis: bool = False  # True: leave the shared-memory, trace and logging APIs open to every client
    admin_key: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    http: bool = True  # False: no HTTP and no metrics port (--allow-http=false --allow-metrics=false), gRPC only
    process: subprocess.Popen | None = None
    started_s: float | None = None
    remove_work_dir: bool = False  # True: stop() deletes work_dir (a temporary folder made for this server)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        system = shutil.which("tritonserver")
        env = dict(os.environ)
        if system:
            binary, backend_args = Path(system), []
        else:
            binary, backends, extra_env = _bundled_server(self.work_dir)
            env.update(extra_env)
            backend_args = [f"--backend-directory={backends}"]
        http_args = ["--http-address=127.0.0.1", f"--http-port={self.ports.http}",
                     "--metrics-address=127.0.0.1", f"--metrics-port={self.ports.metrics}", "--allow-metrics=true"] \
            if self.http else ["--allow-http=false", "--allow-metrics=false"]  # metrics are HTTP too
        args = [
            str(binary), f"--model-repository={self.repo}", *backend_args, *http_args,
            "--grpc-address=127.0.0.1", f"--grpc-port={self.ports.grpc}", "--allow-gpu-metrics=false", "--strict-readiness=true",
            "--exit-on-error=true", "--log-verbose=0", *self.restriction_args(), *tensorrt_args(self.repo),
            *self.extra_args,
        ]
        return args, env

    def restriction_args(self) -> list[str]:
        if self.admin_apis:
            return []
        apis = ",".join(RESTRICTED_APIS)
        return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={self.admin_key}"] * self.http + \
            [f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={self.admin_key}"]

    def admin_headers(self, protocol: str = "http") -> dict[str, str]:
        """The header (HTTP) / metadata (gRPC: Triton prefixes the name) that opens the restricted APIs."""
        name = ADMIN_HEADER if protocol == "http" else f"triton-grpc-protocol-{ADMIN_HEADER}"
        return {name: self.admin_key}

    def start(self, timeout_s: float = 120.0, *, append_log: bool = False) -> float:
        """Start and wait until every model is ready (after warm-up). Returns seconds to ready."""
        if not Path(self.repo, ).is_dir():
            raise ServeError(f"model repository {self.repo} does not exist; run `trt-diffusion package` first")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_path or self.work_dir / "tritonserver.log"
        args, env = self.command()
        log = open(self.log_path, "ab" if append_log else "wb")
        start = time.perf_counter()
        # A new session: stopping the server also stops its python stubs. A Ctrl-C / SIGTERM arriving while
        # the child starts is held until it is recorded in LIVE_SERVERS, where whoever stops it finds it.
        with deferred_stop_signals():
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
            LIVE_SERVERS[id(self)] = self
        log.close()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.perf_counter() - start
        return self.started_s

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        grpc_client = None
        if not self.http:
            import tritonclient.grpc as grpc

            grpc_client = grpc.InferenceServerClient(self.grpc_url)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServeError(f"tritonserver exited with {self.process.returncode} before it was ready:\n"
                                     f"{self.log_tail()}")
                if self._http_ready() if grpc_client is None else _grpc_ready(grpc_client):
                    return
                time.sleep(0.25)
        finally:
            if grpc_client is not None:
                grpc_client.close()
        raise ServeError(f"tritonserver was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _http_ready(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def models_ready(self, names) -> dict[str, bool]:
        """Whether each named model is ready, over HTTP, or gRPC for a server without HTTP."""
        if self.http:
            import tritonclient.http as client_module
        else:
            import tritonclient.grpc as client_module
        client = client_module.InferenceServerClient(self.http_url if self.http else self.grpc_url)
        try:
            return {name: bool(client.is_model_ready(name)) for name in names}
        finally:
            client.close()

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self, timeout_s: float = 120.0) -> float:
        """Start again after the process exited (serve --replicas' supervision, triton/supervise.py): the same
        ports, work folder and admin key, the log continued. What is left of the last run's process group (its
        python stubs) is stopped first. A failed start leaves the work folder (stop() removes it). Returns seconds
        to ready."""
        if self.is_alive():
            raise ServeError(f"tritonserver on {self.grpc_url} is running: nothing to restart")
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGTERM)
            _stop_group(self.process.pid, 5.0)
        keep, self.remove_work_dir = self.remove_work_dir, False
        try:
            return self.start(timeout_s, append_log=True)
        finally:
            self.remove_work_dir = keep

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and every process of its session (the python stubs); a second Ctrl-C / SIGTERM
        meanwhile is held until this is done, so a stop is never abandoned half-way."""
        with deferred_stop_signals():
            if self.process is not None:
                if self.process.poll() is None:
                    _signal_group(self.process.pid, signal.SIGTERM)
                    try:
                        self.process.wait(timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        _signal_group(self.process.pid, signal.SIGKILL)
                        self.process.wait()
                _stop_group(self.process.pid, timeout_s)  # stubs still exiting after the server
            LIVE_SERVERS.pop(id(self), None)
            if self.remove_work_dir:
                shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _grpc_ready(client) -> bool:
    from tritonclient.utils import InferenceServerException

    try:
        return bool(client.is_server_ready(client_timeout=2))
    except InferenceServerException:
        return False


# Servers started and not yet stopped by this process (id -> server): `serve` stops what it started even when
# a stop signal came between a start and the line that would have kept the server in a variable.
LIVE_SERVERS: dict[int, TritonServer] = {}


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc (Linux); [] where /proc is not there."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def _stop_group(pgid: int, timeout_s: float) -> None:
    """Wait for the rest of the server's session to exit after SIGTERM; SIGKILL what is left after the timeout."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pgid):
        _signal_group(pgid, signal.SIGKILL)
