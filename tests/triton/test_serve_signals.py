"""`serve` stops cleanly whenever it is stopped: SIGTERM or Ctrl-C (SIGINT) while tritonserver starts (models
loading, stubs running), while serve times its first requests and while it serves leaves no tritonserver and
no python stub behind, and removes serve's temporary work folder.

Each case runs serve in a child process (the real `serve()`, or the CLI), finds its tritonserver, stops the
child at the phase and then checks the server's whole process group is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trt_diffusion.triton.server import free_port, group_members

pytestmark = [pytest.mark.triton, pytest.mark.timeout(600)]

# The real serve(); "warming" keeps timing first requests (real requests through the entry) in a loop, so the
# stop lands while one is in flight, and says so on stdout.
DRIVER = textwrap.dedent('''
    import sys
    from trt_diffusion.triton import stage

    repo, phase = sys.argv[1], sys.argv[2]
    real = stage.first_requests

    def looping(*args, **kwargs):
        print("PHASE warming", flush=True)
        while True:
            real(*args, **kwargs)

    stage.first_requests = looping
    result = stage.serve(repo, http_port=None, grpc_port=None, metrics_port=None,
                         first_request=phase == "warming", on_ready=lambda report: print("PHASE serving", flush=True))
    print("RETURNED", "ready" if result else "not-ready", flush=True)
''')


@pytest.fixture(scope="module")
def repo(sd15_engines, tmp_path_factory) -> Path:
    from trt_diffusion.triton.repository import PackageOptions, package

    root = tmp_path_factory.mktemp("serve-signals")
    package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name, root / "repo",
            PackageOptions(ensemble=False))
    return root / "repo"


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _tritonserver_of(parent: int) -> int | None:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        if name == "tritonserver" and int(fields[1]) == parent:
            return int(stat.parent.name)
    return None


def _wait_for(predicate, what: str, child: subprocess.Popen, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if child.poll() is not None:
            raise AssertionError(f"serve exited with {child.returncode} before {what}: "
                                 f"{child.stdout.read() if child.stdout else ''}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _wait_line(child: subprocess.Popen, marker: str) -> None:
    for line in child.stdout:
        if marker in line:
            return
    raise AssertionError(f"serve exited ({child.wait()}) before printing {marker!r}")


def _start(command: list[str], tmp: Path) -> subprocess.Popen:
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _check_stopped(child: subprocess.Popen, server: int, tmp: Path) -> str:
    output, _ = child.communicate(timeout=120)
    assert child.returncode == 0, output
    deadline = time.monotonic() + 30  # the session is reaped by init once serve has stopped it
    while group_members(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(server) == [], f"left running: {group_members(server)}\n{output}"
    assert _stat(server) is None or _stat(server)[0] in ("Z", "X")
    left = [p.name for p in tmp.iterdir() if p.name.startswith("trt-diffusion-serve-")]
    assert left == [], "serve's temporary work folder was not removed"
    return output


# SIGINT goes the same way as SIGTERM (one handler): its cases run with the slow tests.
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["sigterm", "sigint"])
def test_stop_while_starting(repo, tmp_path, signum):
    child = _start([sys.executable, "-c", DRIVER, str(repo), "starting"], tmp_path / "tmp")
    server = _wait_for(lambda: _tritonserver_of(child.pid), "tritonserver started", child)
    # models loading: the python stubs run (they import torch and warm up before the server is ready)
    _wait_for(lambda: len(group_members(server)) > 1, "python stubs started", child)
    child.send_signal(signum)
    output = _check_stopped(child, server, tmp_path / "tmp")
    assert "RETURNED not-ready" in output


@pytest.mark.slow  # a server start (~17 s); starting and serving are stopped in the default run
@pytest.mark.parametrize("signum", [signal.SIGTERM], ids=["sigterm"])
def test_stop_while_warming(repo, tmp_path, signum):
    child = _start([sys.executable, "-c", DRIVER, str(repo), "warming"], tmp_path / "tmp")
    _wait_line(child, "PHASE warming")
    server = _tritonserver_of(child.pid)
    assert server is not None
    time.sleep(0.2)  # first requests in flight
    child.send_signal(signum)
    output = _check_stopped(child, server, tmp_path / "tmp")
    assert "RETURNED not-ready" in output


@pytest.mark.slow  # SIGTERM while serving: the CLI test below, in the default run
@pytest.mark.parametrize("signum", [signal.SIGINT], ids=["sigint"])
def test_stop_while_serving(repo, tmp_path, signum):
    child = _start([sys.executable, "-c", DRIVER, str(repo), "serving"], tmp_path / "tmp")
    _wait_line(child, "PHASE serving")
    server = _tritonserver_of(child.pid)
    assert server is not None
    child.send_signal(signum)
    output = _check_stopped(child, server, tmp_path / "tmp")
    assert "RETURNED ready" in output


def test_cli_serve_sigterm_after_ready(repo, tmp_path):
    """The command a user runs: SIGTERM right after it reports ready (the issue's reproduction)."""
    ports = [str(free_port()) for _ in range(3)]
    child = _start([sys.executable, "-m", "trt_diffusion.cli", "serve", "--repo", str(repo), "--http-port", ports[0],
                    "--grpc-port", ports[1], "--metrics-port", ports[2]], tmp_path / "tmp")
    _wait_line(child, "ready in")
    server = _tritonserver_of(child.pid)
    assert server is not None
    child.send_signal(signal.SIGTERM)
    output = _check_stopped(child, server, tmp_path / "tmp")
    assert "stopped" in output
