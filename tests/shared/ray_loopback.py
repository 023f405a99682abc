"""A real Ray cluster for the farm tests: a head and workers started with `ray start` inside a network
namespace of its own (`unshare -n`, loopback only), so the tests reach nothing outside; the namespace, and
every Ray process in it, ends with the test's commands.

The namespace isolates the network only: Ray's session folder (/tmp/ray) and `ray stop --force` (which kills
every Ray process it can see, by name) are machine-wide, so two clusters at once — two pytest-xdist workers
running two farm files — would kill each other (seen in CI as a SIGBUS in the raylet). One cluster runs at a
time, under a lock file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml


def namespace_reason() -> str | None:
    """Why a loopback-only namespace cannot be made here (the tests skip with it), or None."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot make a network namespace: {probe.stderr.strip()}"


def farm_engines_yaml(tmp_path: Path, built_sd15: Path) -> dict:
    """engines.yaml of the session's tiny build with its own workspace holding the verified exports (the
    engines are what the farm builds); skips the test where the namespace cannot be made."""
    reason = namespace_reason()
    if reason:
        pytest.skip(reason)
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(tmp_path / "build")
    shutil.copytree(built_sd15.parent / "build" / "onnx", tmp_path / "build" / "onnx")
    return data


def run_on_loopback_cluster(port: int, workers: list[dict[str, int]], commands: list[str], timeout: int) -> str:
    """Start a head (no custom resources) and one worker per entry of `workers` (its custom resources), one
    CPU each, run `commands` (bash lines; `python` is this interpreter), stop Ray; their stdout."""
    bin_dir = os.path.dirname(sys.executable)
    starts = "\n".join(f"ray start --address=127.0.0.1:{port} $common"
                       + (f" --resources='{json.dumps(resources)}'" if resources else "") + " >/dev/null"
                       for resources in workers)
    script = textwrap.dedent("""
        set -e
        ip link set lo up
        export RAY_USAGE_STATS_ENABLED=0 PATH={bin_dir}:$PATH
        trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
        common="--node-ip-address=127.0.0.1 --num-cpus=1 --disable-usage-stats"
        ray start --head --port={port} --include-dashboard=false $common >/dev/null
    """).format(bin_dir=bin_dir, port=port) + starts + "\n" + "\n".join(commands) + "\n"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(Path(tempfile.gettempdir()) / "trt-diffusion-ray-loopback.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run(["unshare", "-n", "bash", "-c", script], capture_output=True, text=True,
                                env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def results(stdout: str) -> list:
    """The JSON a driver printed on each `RESULT=` line, in order."""
    return [json.loads(line.removeprefix("RESULT=")) for line in stdout.splitlines() if line.startswith("RESULT=")]
