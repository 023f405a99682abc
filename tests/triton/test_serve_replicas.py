"""`serve --replicas N` (docs/deploy.md, N hosts): N tritonservers over one repository on this host, the OpenAI API
fronting all of them. The argument and its refusal through the CLI; stage.serve's start order, ports and stops with
`start` replaced by a recorder (one replica failing to start stops those started, naming it with its log tail); the
supervision of a replica that exits (triton/supervise.py): its restart policy, the loop over stand-in servers, and
TritonServer.restart over a stand-in tritonserver process on PATH; then, in the slow suite, the real CLI serving the
tiny sd15 with two replicas behind the API, one of them SIGKILLed mid-batch and restarted."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from functools import partial
from types import SimpleNamespace

import api_waits
import numpy as np
import pytest

from trt_diffusion import api as api_module
from trt_diffusion.cli import main
from trt_diffusion.errors import ServeError
from trt_diffusion.triton import server as server_module
from trt_diffusion.triton import stage, supervise


def run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


@pytest.mark.parametrize("count", ["0", "-1"])
def test_fewer_than_one_replica_is_refused_before_anything_starts(count, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(api_module, "serve", lambda repo, **options: pytest.fail("started"))
    code, text = run(["serve", "--repo", str(tmp_path), "--replicas", count], capsys)
    assert code == 1
    assert f"--replicas must be at least 1 (the tritonservers to start on this host), got {count}" in text
    assert "starting" not in text


def test_replicas_reach_serve_one_by_default(monkeypatch, capsys, tmp_path):
    seen = []
    monkeypatch.setattr(api_module, "serve", lambda repo, **options: seen.append(options["replicas"]))
    assert run(["serve", "--repo", str(tmp_path), "--replicas", "3", "--openai-port", "8085"], capsys)[0] == 0
    assert run(["serve", "--repo", str(tmp_path)], capsys)[0] == 0
    assert seen == [3, 1]


class FakeServer:
    def __init__(self, stopped: list, index: int):
        self.stopped, self.index = stopped, index

    def is_alive(self) -> bool:
        return False  # serving ends at once: the test needs only the starts and the stops

    process = SimpleNamespace(returncode=-9)
    log_path = "log"

    def log_tail(self) -> str:
        return f"log of {self.index}"

    def restart(self, timeout_s: float) -> float:
        raise ServeError("tritonserver exited with 1 before it was ready:\nTAIL")

    def stop(self) -> None:
        self.stopped.append(self.index)
        server_module.LIVE_SERVERS.pop(id(self), None)


def recorder(fail_at: int | None):
    starts, stopped = [], []

    def start(repo, **options):
        index = len(starts)
        starts.append(options)
        if index == fail_at:  # as TritonServer.start fails: the server it started is stopped, its tail in the error
            raise ServeError(f"tritonserver exited with 1 before it was ready:\nTAIL OF REPLICA {index}")
        server = FakeServer(stopped, index)
        server_module.LIVE_SERVERS[id(server)] = server
        return server, SimpleNamespace(grpc_url=f"127.0.0.1:{9000 + index}")

    return start, starts, stopped


def test_a_replica_that_fails_to_start_stops_the_others_and_is_named_with_its_log_tail(monkeypatch):
    start, starts, stopped = recorder(fail_at=1)
    monkeypatch.setattr(stage, "start", start)
    with pytest.raises(ServeError) as failed:
        stage.serve("repo", http_port=8000, grpc_port=8001, metrics_port=8002, replicas=3,
                    on_ready=lambda reports: pytest.fail("ready"))
    assert str(failed.value).startswith("replica 2 of 3 did not start (the others are stopped): tritonserver exited")
    assert "TAIL OF REPLICA 1" in str(failed.value)
    assert len(starts) == 2 and stopped == [0]  # the third never started, the first stopped


def test_replicas_take_the_given_ports_then_free_ones_and_report_in_order(monkeypatch):
    start, starts, stopped = recorder(fail_at=None)
    monkeypatch.setattr(stage, "start", start)
    monkeypatch.setattr(stage, "supervise", partial(supervise.supervise, sleep=lambda s: None))
    ready = []
    with pytest.raises(ServeError, match=r"exited unexpectedly with -9 \(replica 1 of 2; given up after 3 restarts"):
        stage.serve("repo", http_port=8000, grpc_port=8001, metrics_port=8002, replicas=2, memory_budget_gb=8.0,
                    on_ready=ready.append)
    assert [(s["http_port"], s["grpc_port"], s["metrics_port"]) for s in starts] == [(8000, 8001, 8002),
                                                                                   (None, None, None)]
    assert [s["work_dir"] for s in starts] == [None, None]  # each its own temporary work folder
    assert [s["memory_budget_gb"] for s in starts] == [4.0, 4.0]  # the host's budget shared
    assert [[r.grpc_url for r in reports] for reports in ready] == [["127.0.0.1:9000", "127.0.0.1:9001"]]
    assert sorted(stopped) == [0, 1]


def test_the_restart_policy_backs_off_gives_up_on_quick_failures_and_forgets_them_after_a_stable_run():
    policy = supervise.RestartPolicy()  # 3 quick restarts, stable after 60 s, 1 s doubling to 30 s
    assert [policy.after_exit(5.0) for _ in range(4)] == [1.0, 2.0, 4.0, None]
    policy = supervise.RestartPolicy()
    assert [policy.after_exit(up) for up in (1.0, 1.0, 60.0, 1.0, 1.0, 3600.0, 0.5)] == [1.0, 2.0, 1.0, 2.0, 4.0,
                                                                                        1.0, 2.0]
    policy = supervise.RestartPolicy(max_quick_restarts=10, max_backoff_s=5.0)
    assert [policy.after_exit(0.0) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


class Replica:
    """A server for supervise(): `exits` is when (its clock) each run of it exits, `failed_starts` how many of its
    restarts fail before one succeeds."""

    def __init__(self, clock, exits=(), failed_starts=0):
        self.clock, self.exits, self.failed_starts = clock, list(exits), failed_starts
        self.process = SimpleNamespace(returncode=None)
        self.restarts, self.log_path = [], "replica.log"

    def is_alive(self) -> bool:
        if self.exits and self.clock.now >= self.exits[0]:
            self.exits.pop(0)
            self.process.returncode = -9
        return self.process.returncode is None

    def restart(self, timeout_s: float) -> float:
        self.restarts.append(self.clock.now)
        if self.failed_starts:
            self.failed_starts -= 1
            self.process.returncode = 1
            raise ServeError("tritonserver exited with 1 before it was ready:\nport taken")
        self.process.returncode = None
        return 2.0

    def log_tail(self) -> str:
        return "LAST LINES"


class Clock:
    """supervise()'s clock and sleep: a sleep moves the clock; past `stop_at` the stop signal arrives."""

    def __init__(self, stop_at: float):
        self.now, self.stop_at, self.slept = 0.0, stop_at, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds != supervise.POLL_S:
            self.slept.append(seconds)
        self.now += seconds
        if self.now > self.stop_at:
            raise KeyboardInterrupt


def test_a_replica_that_exits_is_restarted_with_a_log_line_naming_it_and_the_others_run_on(caplog):
    clock = Clock(stop_at=1000.0)
    first, second = Replica(clock), Replica(clock, exits=[10.0, 200.0], failed_starts=1)
    with caplog.at_level("WARNING", "trt_diffusion.triton.serve"), pytest.raises(KeyboardInterrupt):
        supervise.supervise([first, second], 900.0, clock=clock, sleep=clock.sleep)
    said = [record.getMessage() for record in caplog.records]
    assert said == ["replica 2 of 2: tritonserver exited with -9; restarting it on its ports in 1 s (restart 1 of at "
                    "most 3 in a row)",
                    "replica 2 of 2: the restart failed: tritonserver exited with 1 before it was ready:",
                    "replica 2 of 2: tritonserver exited with 1; restarting it on its ports in 2 s (restart 2 of at "
                    "most 3 in a row)",
                    "replica 2 of 2: restarted, ready in 2.0 s (replica.log)",
                    # ran past stable_s: a first quick failure again
                    "replica 2 of 2: tritonserver exited with -9; restarting it on its ports in 1 s (restart 1 of at "
                    "most 3 in a row)",
                    "replica 2 of 2: restarted, ready in 2.0 s (replica.log)"]
    assert first.restarts == [] and clock.slept == [1.0, 2.0, 1.0]
    assert second.restarts == [11.0, 13.0, 201.0] and second.is_alive()


def test_a_replica_that_keeps_failing_quickly_is_given_up_naming_it_with_its_log_tail():
    clock = Clock(stop_at=1000.0)
    replicas = [Replica(clock), Replica(clock), Replica(clock, exits=[5.0, 6.5, 9.0, 13.5])]
    with pytest.raises(ServeError) as given_up:
        supervise.supervise(replicas, 900.0, clock=clock, sleep=clock.sleep)
    assert str(given_up.value) == ("tritonserver exited unexpectedly with -9 (replica 3 of 3; given up after 3 "
                                   "restarts, each failing within 60 s; the others are stopped):\nLAST LINES")
    assert len(replicas[2].restarts) == 3 and clock.now < 20


STAND_IN = """#!{python}
# a stand-in tritonserver: a "stub" child in its process group, /v2/health/ready on --http-port
import http.server, subprocess, sys, time
port = int(next(a for a in sys.argv if a.startswith("--http-port=")).split("=")[1])
stub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("started", stub.pid, flush=True)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


def test_restart_starts_a_killed_server_again_on_its_ports_its_old_stubs_stopped_its_log_continued(
        tmp_path, monkeypatch):
    from trt_diffusion.triton.server import ServerPorts, TritonServer, free_port, group_members

    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.write_text(STAND_IN.format(python=sys.executable))
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "repo").mkdir()
    server = TritonServer(tmp_path / "repo", tmp_path / "work", ServerPorts(free_port(), free_port(), free_port()),
                          remove_work_dir=True)
    try:
        server.start(timeout_s=60)
        first = server.process.pid
        ports, key = server.ports, server.admin_key
        until(lambda: "started" in server.log_path.read_text(), "the stand-in's stub")
        os.kill(first, signal.SIGKILL)
        until(lambda: not server.is_alive(), "the stand-in dying")
        assert group_members(first)  # SIGKILL left its stub running, in its group
        assert server.restart(timeout_s=60) > 0
        assert server.process.pid != first and server.is_alive() and server._http_ready()
        assert server.ports == ports and server.admin_key == key and server.work_dir.is_dir()
        assert not group_members(first)  # the old run's stub stopped
        until(lambda: server.log_path.read_text().count("started") == 2, "the second run in the same log")
        with pytest.raises(ServeError, match="is running: nothing to restart"):
            server.restart()
    finally:
        server.stop()
    assert not server.work_dir.exists() and not group_members(server.process.pid)


def test_the_api_fronts_every_replica(monkeypatch):
    from trt_diffusion.openai_api import server as api_server
    from trt_diffusion.openai_api.settings import ApiSettings

    fronted = []

    class Api:
        def __init__(self, settings):
            fronted.append(settings.triton_url)

        def start(self):
            return self

        def stop(self):
            pass

    monkeypatch.setattr(api_server, "ApiServer", Api)
    monkeypatch.setattr(stage, "serve", lambda repo, on_ready, **options: on_ready(
        [SimpleNamespace(grpc_url="127.0.0.1:9000", metrics_url=""),
         SimpleNamespace(grpc_url="127.0.0.1:9001", metrics_url="")]))
    api_module.serve("repo", openai=ApiSettings("unused:1", port=0), replicas=2)
    assert fronted == ["127.0.0.1:9000,127.0.0.1:9001"]


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(600)
def test_serve_two_replicas_behind_the_api(built_sd15, tmp_path):
    """The real CLI: `serve --replicas 2 --openai-port` on the tiny sd15; /health lists two ready replicas, the
    API's requests are answered by both. Then one replica's tritonserver is SIGKILLed mid-batch (the official client's
    Batch API) while seeded online requests arrive: serve restarts it on its ports, every job line completes once
    with the image one replica gives for its seed, the online requests succeed, /health shows the replica ready
    again and it answers again. SIGINT then stops both tritonservers (the restarted one included) with their stubs."""
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import built_engines
    from trt_diffusion.triton.repository import PackageOptions, package
    from trt_diffusion.triton.server import free_port, group_members

    config = load_engines_file(built_sd15, check_sources=True)
    (name,) = config.models
    model = config.models[name]
    report = package(built_engines(config, name, "onnxruntime"), model.source.path, model.family, name,
                     tmp_path / "repo", PackageOptions(ensemble=False, stream=False), workflows=model.workflows)
    api_port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "trt_diffusion.cli", "serve", "--repo", str(tmp_path / "repo"), "--replicas", "2",
         "--no-first-request", "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port",
         str(free_port()), "--openai-port", str(api_port), "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        for line in child.stdout:
            lines.append(line)
            if "Ctrl-C stops the servers." in line:
                break
        text = "".join(lines)
        assert "starting 2 tritonservers" in text and "replica 2 of 2: ready" in text, text
        assert text.count("gRPC  127.0.0.1:") == 2 and "over the 2 replicas" in text, text
        threading.Thread(target=_read_on, args=(child, lines), daemon=True).start()  # the restart's lines
        base = f"http://127.0.0.1:{api_port}"
        replicas = _health(base)["replicas"]
        assert len(replicas) == 2 and all(r["ready"] for r in replicas), replicas
        references = {seed: _online(base, report.entry, seed, 2) for seed in range(4)}  # one replica's images
        replicas = _health(base)["replicas"]
        assert all(r["served"] >= 1 for r in replicas), replicas  # sequential requests: in turn
        # each replica's queue is read from its own tritonserver's metrics port (serve passes them to the API)
        until(lambda: all(isinstance(r.get("queue"), int) and r.get("metrics_error") is None
                           for r in _health(base)["replicas"]), "each replica's Triton queue in /health", child)
        groups = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_tritonserver_of(int(p), tmp_path)]
        assert len(groups) == 2, groups
        _crash_one_replica_mid_batch(child, lines, base, report.entry, references)
        groups += [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_tritonserver_of(int(p), tmp_path)]
        child.send_signal(signal.SIGINT)
        assert child.wait(120) == 0, "".join(lines)
        assert not any(_alive(p) or group_members(p) for p in groups)  # each server's group: its stubs too
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(30)
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_tritonserver_of(int(p), tmp_path)]:
            os.killpg(pid, signal.SIGKILL)  # a failed run leaves no server behind (each its own process group)


CRASH_LINES = 12  # job lines: 0-3 the reference requests' bodies, the rest heavier (more steps: the batch lasts)
CRASH_STEPS = 8


def _crash_one_replica_mid_batch(child, lines: list[str], base: str, entry: str, references: dict) -> None:
    """SIGKILL replica 2's tritonserver once the batch has completed some lines, send seeded online requests, and
    check what serve, the API and the batch do (the docstring above)."""
    import openai

    text = "".join(lines)
    grpc_ports = [int(x) for x in re.findall(r"gRPC  127\.0\.0\.1:(\d+)", text)]
    victim = _tritonserver_on(child.pid, grpc_ports[1])
    bodies = [{"model": entry, "prompt": "a lighthouse", "size": "64x64", "seed": i,
               "num_inference_steps": 2 if i < 4 else CRASH_STEPS} for i in range(CRASH_LINES)]
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    upload = client.files.create(file=("jobs.jsonl", "".join(
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/images/generations", "body": body}) + "\n"
        for i, body in enumerate(bodies)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                  completion_window="24h")
    at_kill = until(lambda: (b := client.batches.retrieve(batch.id)).request_counts.completed >= 4 and b,
                     "four job lines done")
    os.kill(victim, signal.SIGKILL)
    assert at_kill.status == "in_progress" and at_kill.request_counts.completed < CRASH_LINES, at_kill

    online: dict[int, object] = {}

    def ask(seed: int) -> None:
        try:
            online[seed] = _online(base, entry, seed, CRASH_STEPS)
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            online[seed] = err

    asks = [threading.Thread(target=ask, args=(seed,)) for seed in range(CRASH_LINES - 4, CRASH_LINES)]
    for thread in asks:
        thread.start()
    restarted = until(lambda: "replica 2 of 2: restarted" in "".join(lines)
                       and _tritonserver_on(child.pid, grpc_ports[1], None), "serve restarting replica 2", child)
    for thread in asks:
        thread.join(GUARD_S)
    assert all(isinstance(online.get(seed), np.ndarray) for seed in online) and len(online) == 4, online
    said = "".join(lines)
    assert f"replica 2 of 2: tritonserver exited with -{int(signal.SIGKILL)}" in said, said
    assert restarted != victim and not _alive(victim)
    assert _health(base)["replicas"][1]["failures"] >= 1  # the API saw it lost (its calls UNAVAILABLE)...
    until(lambda: all(r["ready"] for r in _health(base)["replicas"]), "replica 2 ready again in /health", child)

    done = until(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                  "the batch completing", child)
    assert done.status == "completed" and done.request_counts.completed == CRASH_LINES, done
    assert done.request_counts.failed == 0 and done.error_file_id is None, done
    records = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in records) == sorted(f"line-{i}" for i in range(CRASH_LINES))  # once each
    images = {}
    for record in records:
        assert record["response"]["status_code"] == 200, record
        (item,) = record["response"]["body"]["data"]
        images[int(record["custom_id"].split("-")[1])] = _pixels(item["b64_json"])
    for seed, reference in references.items():  # the online requests before the crash: the same bodies
        assert np.array_equal(images[seed], reference), seed
    for seed, answer in online.items():  # the online requests after the crash: the job lines' bodies
        assert np.array_equal(images[seed], answer), seed

    served_before = _health(base)["replicas"][1]["served"]
    for seed in range(2):  # sequential: in turn, so the restarted replica answers again
        assert np.array_equal(_online(base, entry, seed, 2), references[seed])
    replicas = _health(base)["replicas"]
    assert replicas[1]["served"] > served_before and all(r["ready"] for r in replicas), replicas


def _read_on(child: subprocess.Popen, lines: list[str]) -> None:
    for line in child.stdout:
        lines.append(line)


def _online(base: str, entry: str, seed: int, steps: int):
    body = {"model": entry, "prompt": "a lighthouse", "size": "64x64", "seed": seed, "num_inference_steps": steps}
    request = urllib.request.Request(base + "/v1/images/generations", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        (item,) = json.loads(response.read())["data"]
    return _pixels(item["b64_json"])


def _pixels(b64: str):
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image.convert("RGB"))


def _health(base: str) -> dict:
    with urllib.request.urlopen(base + "/health", timeout=30) as response:
        return json.loads(response.read())


GUARD_S = 180  # a step that never happens fails its test instead of hanging it
until = partial(api_waits.until, guard_s=GUARD_S)  # serve's two tritonservers restart slower than the API alone


def _tritonserver_on(parent: int, grpc_port: int, missing=AssertionError):
    """The pid of the tritonserver `parent` (serve) started on `grpc_port`, from /proc (never by name alone)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and args[0].endswith(b"tritonserver") and f"--grpc-port={grpc_port}".encode() in args \
                and _alive(int(entry)):
            return int(entry)
    if missing is None:
        return None
    raise missing(f"no tritonserver of {parent} on gRPC port {grpc_port}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[-1][:1] != "Z"


def _is_tritonserver_of(pid: int, tmp_path) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            args = cmdline.read().split(b"\0")
    except OSError:
        return False
    return bool(args) and args[0].endswith(b"tritonserver") and any(str(tmp_path).encode() in a for a in args)
