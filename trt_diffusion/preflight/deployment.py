"""What the checks run against: a Triton server (one preflight started on loopback, or the one at --url) or,
in process, the same EnginePipeline over the same engines.

A Deployment answers image requests and says what it is made of (buckets, ControlNets, engine keys, instances,
queue bound), how much memory it holds, and how many denoiser calls it has run (counted by Triton's statistics
of the denoiser engine models, or by wrapped runners in process): that count is how the cancellation check tells
that a loop stopped early without timing it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..engines_file.engine_spec import Bucket, Size
from ..errors import ServeError
from ..step_cache import PIECES
from ..triton.client import ImageRequest, RequestCancelled

# the denoiser calls a deadline is checked before: a step cache's pieces are denoiser calls too
DENOISERS = ("unet", "transformer", *(piece for pieces in PIECES.values() for piece in pieces))


@dataclass(frozen=True)
class MemoryReading:
    cpu_bytes: int | None
    gpu_bytes: int | None
    source: str  # what was measured, in words


@dataclass(frozen=True)
class ServedBucket:
    label: str
    request: Size  # the size a request for this bucket asks for (its opt)
    largest: Size  # its largest size (max), what the memory check asks for


@dataclass
class Deployment:
    """The common description; subclasses implement generate / memory / denoiser_calls / health."""

    kind: str  # served | in-process
    pipeline: str
    family: str
    buckets: list[ServedBucket]
    controlnets: list[str]
    engine_keys: list[str]
    instances: int | None = None  # requests served at once (the entry's instance count)
    max_queue_size: int | None = None  # the entry's queue bound; None: none declared
    protocol: str | None = None
    url: str | None = None
    started_by_preflight: bool = False
    first_requests: dict[str, float] = field(default_factory=dict)  # bucket label -> seconds, timed at start
    notes: list[str] = field(default_factory=list)

    def generate(self, request: ImageRequest, timeout_s: float) -> np.ndarray:
        raise NotImplementedError

    def memory(self) -> MemoryReading | None:
        return None

    def memory_unavailable_reason(self) -> str:
        return "no memory reading available"

    def denoiser_calls(self) -> int | None:
        return None

    def health(self) -> str | None:
        """None when healthy, else why not."""
        return None

    def cancel_unavailable_reason(self) -> str | None:
        return None

    def taking_turns(self):
        """A context in which concurrent requests' denoiser calls alternate (where this deployment can order
        them): the isolation check then sees steps interleave by construction, not by the OS scheduler's luck.
        A server orders its own requests: there this is a no-op."""
        return contextlib.nullcontext()

    def describe(self) -> dict:
        return {"kind": self.kind, "pipeline": self.pipeline, "url": self.url, "protocol": self.protocol,
                "started_by_preflight": self.started_by_preflight, "instances": self.instances,
                "max_queue_size": self.max_queue_size, "buckets": [b.label for b in self.buckets],
                "controlnets": list(self.controlnets), "engine_keys": list(self.engine_keys)}

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- in process


class _Cancelled(Exception):
    pass


class _CountingRunner:
    """A runner that counts the denoiser's calls and honours the calling thread's deadline before each call,
    as the served BLS runners check `request.is_cancelled()`."""

    def __init__(self, runner, counter: _Counter, is_denoiser: bool, honour_deadline: bool):
        self._runner, self._counter, self._is_denoiser, self._honour = runner, counter, is_denoiser, honour_deadline
        self.inputs = runner.inputs

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def run(self, feeds):
        deadline = getattr(self._counter.local, "deadline", None)
        if self._honour and deadline is not None and time.monotonic() > deadline:
            raise _Cancelled()
        if self._is_denoiser:
            self._counter.take_turn()
            self._counter.add()
        return self._runner.run(feeds)


class _Counter:
    """Denoiser calls counted; with `turns` on, a thread that made the last call waits (bounded) for another
    request's call before its next one, so concurrent requests step in alternation."""

    TURN_WAIT_S = 0.5  # bounded: a neighbour still encoding its prompt or decoding must not stall this one long

    def __init__(self):
        self.lock, self.value, self.local = threading.Lock(), 0, threading.local()
        self.turns_on, self.turns = False, threading.Condition()
        self.last_caller: int | None = None
        self.in_flight = 0  # requests inside generate()

    def add(self) -> None:
        with self.lock:
            self.value += 1

    def take_turn(self) -> None:
        if not self.turns_on:
            return
        me = threading.get_ident()
        with self.turns:
            self.turns.wait_for(lambda: self.last_caller != me or self.in_flight <= 1, self.TURN_WAIT_S)
            self.last_caller = me
            self.turns.notify_all()

    def enter(self) -> None:
        with self.turns:
            self.in_flight += 1

    def leave(self) -> None:
        with self.turns:
            self.in_flight -= 1
            self.turns.notify_all()


class InProcessDeployment(Deployment):
    """EnginePipeline over a RunnerTable, in this process. No queue and no server: the overload check is n/a."""

    def __init__(self, pipeline: str, family: str, model_dir, table, engine_keys: list[str], buckets: list[Bucket],
                 *, honour_deadline: bool = True, instances: int = 2, workflows=None, text_lengths=None,
                 step_cache=None):
        from ..runtime.engines import RunnerTable
        from ..runtime.pipeline import EnginePipeline

        self.counter = _Counter()
        wrapped = RunnerTable()
        for entry in table.entries:
            wrapped.add(entry.component, _CountingRunner(entry.runner, self.counter, entry.component in DENOISERS
                                                         and entry.controlnet is None, honour_deadline),
                        bucket=entry.bucket, batch=entry.batch, controlnet=entry.controlnet)
        self.table = wrapped
        # text_lengths: a Qwen-Image model's engines.yaml range, so prompts are truncated where its engines end
        # step_cache: engines.yaml's, so every check runs the cached schedule where it is on (as the server does)
        self.engine_pipeline = EnginePipeline(model_dir, family, wrapped, workflows, text_lengths=text_lengths,
                                              step_cache=step_cache)
        controlnets = sorted({e.controlnet for e in table.entries if e.controlnet})
        served = [ServedBucket(b.label, b.opt, b.max) for b in buckets]
        super().__init__("in-process", pipeline, str(family), served, controlnets, sorted(engine_keys),
                         instances=instances)

    def generate(self, request: ImageRequest, timeout_s: float) -> np.ndarray:
        from ..runtime.pipeline import GenerationRequest

        self.counter.local.deadline = time.monotonic() + timeout_s
        self.counter.enter()
        try:
            return self.engine_pipeline.generate(GenerationRequest(
                prompt=request.prompt, height=request.height, width=request.width, steps=request.steps,
                guidance_scale=request.guidance_scale, seed=request.seed, negative_prompt=request.negative_prompt,
                scheduler=request.scheduler or "default", controlnet=request.controlnet,
                control_image=request.control_image,
                controlnet_scale=1.0 if request.controlnet_scale is None else request.controlnet_scale,
                workflow=request.workflow, init_image=request.init_image, mask=request.mask,
                strength=request.strength, frames=request.frames or 0,
                guidance_scale_2=request.guidance_scale_2, step_cache=request.step_cache)).images[0]
        except _Cancelled:
            raise RequestCancelled(f"in process: deadline of {timeout_s:g} s passed") from None
        finally:
            self.counter.leave()
            self.counter.local.deadline = None

    @contextlib.contextmanager
    def taking_turns(self):
        self.counter.turns_on = True
        try:
            yield
        finally:
            self.counter.turns_on = False

    def memory(self) -> MemoryReading:
        import os

        import psutil

        return MemoryReading(psutil.Process(os.getpid()).memory_info().rss, None, "RSS of this process")

    def denoiser_calls(self) -> int:
        return self.counter.value


# ---------------------------------------------------------------------------- served


def _as_int(value) -> int:
    return int(value or 0)  # gRPC's JSON writes int64 as strings


class ServedDeployment(Deployment):
    """A Triton server, through tritonclient (one client per thread)."""

    def __init__(self, url: str, protocol: str, *, pipeline: str, family: str, buckets: list[ServedBucket],
                 controlnets: list[str], engine_keys: list[str], denoiser_models: list[str],
                 instances: int | None, max_queue_size: int | None, entry: str, server=None,
                 metrics_url: str | None = None):
        super().__init__("served", pipeline, family, buckets, controlnets, sorted(engine_keys), instances=instances,
                         max_queue_size=max_queue_size, protocol=protocol, url=url,
                         started_by_preflight=server is not None)
        self.entry = entry
        self.denoiser_models = denoiser_models
        self.server = server
        self.metrics_url = metrics_url
        self._local = threading.local()
        self._clients: list = []
        self._lock = threading.Lock()

    def client(self):
        from ..triton.client import connect

        client = getattr(self._local, "client", None)
        if client is None:
            client = connect(self.url, self.protocol, 600.0)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def generate(self, request: ImageRequest, timeout_s: float) -> np.ndarray:
        from ..triton.client import client_module, infer

        return infer(self.client(), client_module(self.protocol), self.entry, request, protocol=self.protocol,
                     timeout_s=timeout_s, url=self.url)

    def cancel_unavailable_reason(self) -> str | None:
        if self.protocol == "http":
            return ("over HTTP Triton cannot cancel a request: a client that gives up leaves it running "
                    "(run preflight with --protocol grpc to check cancellation)")
        return None

    # -- memory: the server's process tree when we know its pid, else Triton's metrics endpoint

    def server_pid(self) -> int | None:
        if self.server is not None and self.server.is_alive():
            return self.server.process.pid
        return _listening_pid(self.url)

    def memory(self) -> MemoryReading | None:
        pid = self.server_pid()
        if pid is not None:
            reading = process_tree_rss(pid)
            if reading is not None:
                return reading
        return metrics_memory(self.metrics_url) if self.metrics_url else None

    def memory_unavailable_reason(self) -> str:
        return (f"the server at {self.url} is not a process of this machine and no metrics endpoint answered "
                f"({self.metrics_url or 'none given'}; pass --metrics-url HOST:PORT)")

    # -- counted denoiser calls: Triton's inference statistics of the denoiser engine models

    def denoiser_calls(self) -> int | None:
        client = self.client()
        total = 0
        for name in self.denoiser_models:
            try:
                stats = client.get_inference_statistics(name, **_as_json(self.protocol))
            except Exception:  # noqa: BLE001 - statistics unavailable: not counted
                return None
            for model in stats.get("model_stats", []):
                total += _as_int(model.get("inference_stats", {}).get("success", {}).get("count"))
        return total

    def health(self) -> str | None:
        try:
            client = self.client()
            if not (client.is_server_live() and client.is_server_ready()):
                return f"Triton at {self.url} is not live and ready"
            if not client.is_model_ready(self.entry):
                return f"model {self.entry} is not ready"
        except Exception as err:  # noqa: BLE001
            return f"Triton at {self.url} does not answer: {err}"
        if self.server is not None and not self.server.is_alive():
            return f"tritonserver exited with {self.server.process.returncode}"
        return None

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
        if self.server is not None:
            self.server.stop()


def _as_json(protocol: str) -> dict:
    return {"as_json": True} if protocol == "grpc" else {}


def process_tree_rss(pid: int) -> MemoryReading | None:
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return MemoryReading(total, _gpu_bytes([p.pid for p in processes]),
                         f"RSS of the server's process tree (pid {pid}, {len(processes)} processes)")


def _gpu_bytes(pids: list[int]) -> int | None:
    """GPU memory of these processes through NVML, where pynvml and a GPU are present."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        wanted, total = set(pids), 0
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in wanted and process.usedGpuMemory:
                    total += process.usedGpuMemory
        return total
    except Exception:  # noqa: BLE001 - no driver, no GPU: not reported
        return None


def _listening_pid(url: str | None) -> int | None:
    """The pid listening on a loopback URL's port (a `trt-diffusion serve` on this machine)."""
    import psutil

    if not url:
        return None
    host, _, port = url.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]") or not port.isdigit():
        return None
    try:
        for connection in psutil.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == int(port):
                return connection.pid
    except (psutil.Error, OSError):
        return None
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: metric name (labels dropped, same names summed) -> value."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def metrics_memory(metrics_url: str) -> MemoryReading | None:
    import urllib.error
    import urllib.request

    url = metrics_url if "://" in metrics_url else f"http://{metrics_url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            values = parse_metrics(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None
    cpu, gpu = values.get("nv_cpu_memory_used_bytes"), values.get("nv_gpu_memory_used_bytes")
    if cpu is None and gpu is None:
        return None
    return MemoryReading(None if cpu is None else int(cpu), None if gpu is None else int(gpu),
                         f"Triton metrics at {url} (the machine's used memory)")


class MemorySampler:
    """Samples a deployment's memory in a thread; `peak` holds the largest CPU and GPU readings."""

    def __init__(self, read: Callable[[], MemoryReading | None], interval_s: float = 0.05):
        self.read, self.interval_s = read, interval_s
        self.peak_cpu: int | None = None
        self.peak_gpu: int | None = None
        self.source = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _take(self) -> None:
        reading = self.read()
        if reading is None:
            return
        self.source = reading.source
        if reading.cpu_bytes is not None:
            self.peak_cpu = max(self.peak_cpu or 0, reading.cpu_bytes)
        if reading.gpu_bytes is not None:
            self.peak_gpu = max(self.peak_gpu or 0, reading.gpu_bytes)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._take()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._take()


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ServeError(message)
