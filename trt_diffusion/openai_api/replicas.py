"""Several Triton servers behind one API (docs/deploy.md, "N hosts"): replicas of one model repository, each its own
gRPC client, used as one client by the rest of the API (the online routes, the catalog, the job runner).

The decisions are ReplicaRouter's (pure, its clock injected):

- **Which replica**: the ready replica with the least load, ties taken in turn (round robin). A replica's load is
  the requests waiting in its Triton's queues, read from its metrics (`nv_inference_pending_request_count`, every
  model summed: triton_metrics.py) about once a second, plus this API's calls in flight to it now: the queue sees
  every client of the replica (other APIs, `generate --url`), the count covers what this API sent since the last
  reading. A call of this API waiting in Triton's queue counts twice (in flight and queued): a queue means every
  instance of the replica is busy, so a queued call weighs more than a running one. A replica without metrics (no
  metrics URL given, Triton without its metrics port) or whose last reading failed or is older than
  METRICS_MAX_AGE_S is loaded by this API's calls alone; a failed reading is not a failure of the replica. A
  diffusion request's cost varies by steps, size and kind (an image, a clip) over two orders of magnitude, so
  counting what is unfinished balances what turns alone would not; the turns spread an idle API's sequential
  requests.
- **A replica that fails** a call with UNAVAILABLE (connection refused or reset, the server going away: gRPC's
  status for "the server is not there", never a request's own error, which Triton answers INVALID_ARGUMENT,
  NOT_FOUND, or for a full queue UNAVAILABLE in words of its own) is marked down, and the call goes once more to another ready replica. A call is
  one request to Triton with its seed already drawn (the API draws a seed for every request that sends none), so
  the retry gives the images the first replica would have.
- **A replica marked down** is left out until a probe (Triton's ServerReady, the `/v2/health/ready` of gRPC)
  says it is ready again: the first call after its back-off (1 s, doubling to 16 s while probes fail) starts the
  probe in the background. With no replica ready, a call goes to the one whose back-off ends first (then once
  more to another): so a down replica is never refused untried, and one replica behaves as the API always has.
  When every try fails, the caller gets the last replica's UNAVAILABLE, which the API answers 503 `Triton is
  unavailable: ...` (a job line waits and runs again).
- **A request with LoRAs** (the LORAS input: its set canonical, names sorted with their scales) goes to the replica
  its set hashes to, so a replica keeps the sets it holds (each refit LoRA set is loaded by the replica that runs
  it): rendezvous (highest-random-weight) hashing, each ready replica scored by a hash of its URL and the set, the
  highest taking it. Adding a replica moves only the sets it now wins; losing one (marked down, as any) moves only
  the sets it held, each to its own next choice, where that set's retry goes too. When the set's replica is
  saturated, its load more than SATURATED_MARGIN above the least-loaded ready replica's, the call goes to the
  least-loaded as above (the set is loaded there too: the price of not queueing behind a hot set). A request
  without LoRAs (or with an empty set) goes by the least load."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from . import triton_metrics

log = logging.getLogger("trt_diffusion.openai_api.replicas")
BACKOFF_S = 1.0  # a replica's first re-probe comes this long after it failed
MAX_BACKOFF_S = 16.0  # doubled per failed probe up to this
PROBE_TIMEOUT_S = 2.0
SATURATED_MARGIN = 2  # a LoRA set's replica with a load above the least-loaded's + this: the least-loaded takes it
METRICS_EVERY_S = 1.0  # each ready replica's metrics are read this often
METRICS_TIMEOUT_S = 1.0  # a reading not answered within this has failed (the replica is loaded by this API's calls)
METRICS_MAX_AGE_S = 5.0  # a reading older than this (its poll stalled) no longer counts
CHANNEL_ARGS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30),
                # gRPC's reconnect back-off grows to 120 s by default: a restarted replica would stay unreachable
                # through this channel long after its probe could see it
                ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 4000),
                # each channel its own connections: by default channels to one address share them, back-off
                # included, so a probe's new channel would wait out the old one's back-off
                ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Replica:
    url: str
    metrics_url: str | None = None  # Triton's Prometheus endpoint (triton_metrics.metrics_url); None: not read
    ready: bool = True  # taken as ready until a call or a probe says otherwise
    in_flight: int = 0
    queue: int | None = None  # requests waiting in its Triton at the last reading; None: not known
    queue_at: float = 0.0  # when that reading was taken (the router's clock)
    metrics_error: str | None = None  # why the last reading failed
    backoff_s: float = BACKOFF_S
    probe_at: float = 0.0  # when a down replica is probed next
    probing: bool = False
    served: int = 0  # calls it answered (any answer but UNAVAILABLE)
    failures: int = 0  # calls it failed with UNAVAILABLE


class ReplicaRouter:
    """Which replica takes a call, and what a failure or a probe changes. No I/O: ReplicaClient does the calls."""

    def __init__(self, urls, clock: Callable[[], float] = time.monotonic, metrics_urls=()):
        """`metrics_urls`: each replica's metrics URL in `urls`' order (None for one not read), or none at all."""
        if not urls:
            raise ValueError("no Triton replica")
        metrics_urls = tuple(metrics_urls) or (None,) * len(urls)
        if len(metrics_urls) != len(urls):
            raise ValueError(f"{len(metrics_urls)} metrics URLs for {len(urls)} Triton replicas")
        self.replicas = [Replica(url, metrics) for url, metrics in zip(urls, metrics_urls)]
        self.clock = clock
        self._turn = 0  # round robin among ties

    def queue(self, index: int) -> int | None:
        """The replica's Triton queue at its last reading; None when not known or older than METRICS_MAX_AGE_S."""
        replica = self.replicas[index]
        if replica.queue is None or self.clock() - replica.queue_at > METRICS_MAX_AGE_S:
            return None
        return replica.queue

    def load(self, index: int) -> int:
        """What a call sent to the replica waits behind: its Triton queue (when known) + this API's calls in flight."""
        return self.replicas[index].in_flight + (self.queue(index) or 0)

    def pick(self, exclude: frozenset[int] = frozenset(), lora_key: str | None = None) -> int | None:
        """The replica for a call, not one of `exclude` (those this call tried): with `lora_key` (a canonical LoRA
        set), the ready one it hashes to unless that one is saturated; else the ready one with the least load (ties
        in turn); none ready: the down one whose back-off ends first; None: every one was tried."""
        count = len(self.replicas)
        order = [(self._turn + step) % count for step in range(count)]
        ready = [i for i in order if self.replicas[i].ready and i not in exclude]
        loads = {i: self.load(i) for i in ready}
        if ready and lora_key is not None:
            chosen = max(ready, key=lambda i: rendezvous_score(self.replicas[i].url, lora_key))
            if loads[chosen] <= min(loads.values()) + SATURATED_MARGIN:
                return chosen
        if ready:
            chosen = min(ready, key=loads.__getitem__)  # min keeps the first of ties: the turn
            self._turn = (chosen + 1) % count
            return chosen
        down = [i for i in order if i not in exclude]
        return min(down, key=lambda i: self.replicas[i].probe_at) if down else None

    def started(self, index: int) -> None:
        self.replicas[index].in_flight += 1

    def finished(self, index: int, unavailable: bool, answered: bool = True) -> None:
        """A call ended: UNAVAILABLE marks the replica down (probed after its back-off); an answer, an error of the
        request included, is the replica working; neither (cancelled, or timed out): no news of the replica."""
        replica = self.replicas[index]
        replica.in_flight -= 1
        if not unavailable:
            if answered:
                replica.served += 1
                if not replica.ready:  # a last-resort call reached it: ready again
                    self._mark_ready(replica)
            return
        replica.failures += 1
        if replica.ready:
            replica.ready = False
            replica.queue = None  # read again once it is back
            replica.backoff_s = BACKOFF_S
            replica.probe_at = self.clock() + replica.backoff_s
            log.warning("Triton replica %s is unavailable: marked down, probed again in %.0f s", replica.url,
                        replica.backoff_s)

    def due_probes(self) -> list[int]:
        """The down replicas whose back-off has passed and that no probe is asking now (marked as being probed)."""
        now = self.clock()
        due = [i for i, r in enumerate(self.replicas) if not r.ready and not r.probing and now >= r.probe_at]
        for index in due:
            self.replicas[index].probing = True
        return due

    def probed(self, index: int, ready: bool) -> None:
        replica = self.replicas[index]
        replica.probing = False
        if replica.ready:
            return  # a call reached it meanwhile
        if ready:
            self._mark_ready(replica)
            return
        replica.backoff_s = min(replica.backoff_s * 2, MAX_BACKOFF_S)
        replica.probe_at = self.clock() + replica.backoff_s

    def scraped(self, index: int, queue: int) -> None:
        """A reading of the replica's metrics: `queue` requests wait in its Triton."""
        replica = self.replicas[index]
        if replica.metrics_error is not None:
            log.warning("Triton replica %s: its metrics are read again (%s)", replica.url, replica.metrics_url)
        replica.queue, replica.queue_at, replica.metrics_error = queue, self.clock(), None

    def scrape_failed(self, index: int, reason: str) -> None:
        """A reading that failed: the replica is loaded by this API's calls alone until one succeeds (it stays
        ready: Triton's metrics port is not the gRPC port its calls use)."""
        replica = self.replicas[index]
        if replica.metrics_error is None:
            log.warning("Triton replica %s: its metrics at %s cannot be read (%s); routed by this API's calls in "
                        "flight until they can", replica.url, replica.metrics_url, reason)
        replica.queue, replica.metrics_error = None, reason

    def _mark_ready(self, replica: Replica) -> None:
        replica.ready = True
        replica.backoff_s = BACKOFF_S
        log.warning("Triton replica %s is ready again", replica.url)

    def state(self) -> list[dict]:
        """/health's replica list: `queue` is the Triton queue the routing counts (None: not known; then, where
        a metrics URL was given, `metrics_error` says why)."""
        states = []
        for index, r in enumerate(self.replicas):
            queue, error = self.queue(index), r.metrics_error
            if queue is None and error is None and r.queue is not None:
                error = f"the last reading is {self.clock() - r.queue_at:.0f} s old"
            states.append({"url": r.url, "ready": r.ready, "in_flight": r.in_flight, "queue": queue,
                           "metrics": r.metrics_url, "metrics_error": error, "served": r.served,
                           "failures": r.failures})
        return states


def rendezvous_score(url: str, key: str) -> int:
    """The replica's weight for a key (highest-random-weight hashing): stable across processes and runs."""
    return int.from_bytes(hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest(), "big")


def lora_key(inputs) -> str | None:
    """The canonical LoRA set a request's inputs carry (their LORAS tensor: names sorted, with their scales, as
    lora_sets.to_json writes it); None without LoRAs, or where LORAS cannot be read (the entry refuses it)."""
    from ..errors import RuntimeInputError
    from ..triton import lora_sets
    from .catalog import LORAS_INPUT

    tensor = next((i for i in inputs or () if getattr(i, "name", lambda: None)() == LORAS_INPUT), None)
    if tensor is None:
        return None
    try:
        content = tensor._get_content()  # BYTES, serialized: a little-endian uint32 length, then the bytes
        (size,) = struct.unpack_from("<I", content)
        lora_set = lora_sets.parse_loras(bytes(content[4:4 + size]).decode("utf-8"))
    except (RuntimeInputError, struct.error, UnicodeDecodeError, TypeError, AttributeError):
        return None
    return lora_sets.to_json(lora_set) if lora_set else None


def is_unavailable(error: BaseException) -> bool:
    """Whether a call's error says the replica is not there (gRPC UNAVAILABLE), not that the request was refused:
    Triton answers a full queue UNAVAILABLE too, in words of its own (the API's 429: the replica is working)."""
    from tritonclient.utils import InferenceServerException

    from .triton_calls import BUSY_MARKERS

    if not isinstance(error, InferenceServerException) or "UNAVAILABLE" not in str(error.status() or ""):
        return False
    message = (error.message() or "").lower()
    return not any(marker in message for marker in BUSY_MARKERS)


def _reading_error(error: BaseException) -> str:
    """A failed metrics reading in a few words: urllib's reason, an HTTP status, or the parser's message."""
    import urllib.error

    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return str(error) if isinstance(error, (OSError, triton_metrics.MetricsError)) else \
        f"{type(error).__name__}: {error}"


def _no_answer(error: BaseException) -> bool:
    """A timeout or a cancel: the call ended without the replica saying anything."""
    status = str(getattr(error, "status", lambda: "")() or "")
    return "DEADLINE_EXCEEDED" in status or "CANCELLED" in status


class ReplicaClient:
    """tritonclient.grpc.aio's InferenceServerClient over several replicas: `infer` and the reads the API makes
    (the repository index, a model's config, live/ready) each go to one replica as ReplicaRouter decides, retried
    once on another when that replica is unavailable. With `metrics_urls`, each ready replica's metrics are read
    every METRICS_EVERY_S (from `start()`, or the first call, to `close()`) for the router's load figure."""

    MAX_TRIES = 2  # the call, and once more on another replica

    def __init__(self, urls, clock: Callable[[], float] = time.monotonic, metrics_urls=(),
                 metrics_every_s: float = METRICS_EVERY_S, metrics_timeout_s: float = METRICS_TIMEOUT_S):
        self.router = ReplicaRouter(urls, clock, metrics_urls)
        self.clients = [_client(url) for url in urls]
        self._retired: list = []  # channels replaced after a probe (closed at the end: calls may still use them)
        self._probes: set[asyncio.Task] = set()
        self.metrics_every_s, self.metrics_timeout_s = metrics_every_s, metrics_timeout_s
        self._readers: list[asyncio.Task] | None = None  # one loop per replica with a metrics URL, once started

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.router.replicas]

    def state(self) -> list[dict]:
        return self.router.state()

    def start(self) -> ReplicaClient:
        """Start reading the replicas' metrics (in the running event loop; once: later calls do nothing)."""
        if self._readers is None:
            self._readers = [asyncio.ensure_future(self._read_metrics(index))
                             for index, replica in enumerate(self.router.replicas) if replica.metrics_url]
        return self

    async def _read_metrics(self, index: int) -> None:
        """Every metrics_every_s while the replica is ready: its Triton queue, or why it could not be read."""
        replica = self.router.replicas[index]
        while True:
            if replica.ready:
                try:
                    queue = await asyncio.wait_for(asyncio.to_thread(
                        triton_metrics.read_queue, replica.metrics_url, self.metrics_timeout_s), self.metrics_timeout_s)
                except TimeoutError:  # asyncio's, or the socket's
                    self.router.scrape_failed(index, f"no answer within {self.metrics_timeout_s:g} s")
                except Exception as err:  # noqa: BLE001 - a reading's failure is never the API's
                    self.router.scrape_failed(index, _reading_error(err))
                else:
                    if replica.ready:  # not marked down while it was read
                        self.router.scraped(index, queue)
            await asyncio.sleep(self.metrics_every_s)

    async def _call(self, method: str | Callable, *args, route_key: str | None = None, **kwargs):
        """`method` of a replica's client (a name), or method(client, ...); `route_key`: a canonical LoRA set."""
        self.start()
        self._start_probes()
        tried: set[int] = set()
        while True:
            index = self.router.pick(frozenset(tried), route_key)
            tried.add(index)
            self.router.started(index)
            unavailable = answered = False  # stays so when the call is cancelled
            client = self.clients[index]
            try:
                result = await (getattr(client, method)(*args, **kwargs) if isinstance(method, str)
                                else method(client, *args, **kwargs))
                answered = True
                return result
            except Exception as err:
                unavailable = is_unavailable(err)
                answered = not unavailable and not _no_answer(err)
                if not unavailable or len(tried) >= min(self.MAX_TRIES, len(self.clients)):
                    raise
                log.warning("%s on Triton replica %s: unavailable (%s); trying another replica",
                            method if isinstance(method, str) else getattr(method, "func", method).__name__,
                            self.router.replicas[index].url, err.message())
            finally:
                self.router.finished(index, unavailable, answered)

    def _start_probes(self) -> None:
        for index in self.router.due_probes():
            task = asyncio.ensure_future(self._probe(index))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe(self, index: int) -> None:
        """ServerReady on a new channel (the replica's own may be waiting out gRPC's reconnect back-off); ready:
        the new channel replaces it."""
        probe = _client(self.router.replicas[index].url)
        try:
            ready = bool(await probe.is_server_ready(client_timeout=PROBE_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - not reachable: still down
            ready = False
        if ready:
            self._retired.append(self.clients[index])
            self.clients[index] = probe
        else:
            await probe.close()
        self.router.probed(index, ready)

    async def infer(self, *args, on_partial: Callable | None = None, **kwargs):
        """The client's `infer`; with `on_partial`, of a decoupled model (a stream entry) over a gRPC stream: each
        response before the one carrying the asked `outputs` goes to on_partial(result), that one is returned."""
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
        key = lora_key(inputs)  # a request with LoRAs: to the replica its set hashes to
        if on_partial is None:
            return await self._call("infer", *args, route_key=key, **kwargs)
        return await self._call(partial(stream_infer, on_partial=on_partial), *args, route_key=key, **kwargs)

    async def get_model_repository_index(self, *args, **kwargs):
        return await self._call("get_model_repository_index", *args, **kwargs)

    async def get_model_config(self, *args, **kwargs):
        return await self._call("get_model_config", *args, **kwargs)

    async def get_model_metadata(self, *args, **kwargs):
        return await self._call("get_model_metadata", *args, **kwargs)

    async def is_server_live(self, *args, **kwargs):
        return await self._call("is_server_live", *args, **kwargs)

    async def is_server_ready(self, *args, **kwargs):
        return await self._call("is_server_ready", *args, **kwargs)

    async def close(self) -> None:
        tasks = [*self._probes, *(self._readers or ())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in (*self.clients, *self._retired):
            await client.close()


async def stream_infer(client, model_name: str, inputs: list, *, outputs: list, on_partial: Callable,
                       priority: int = 0, parameters: dict | None = None, client_timeout: float | None = None):
    """One request to the decoupled model `model_name` over `client`'s gRPC stream (tritonclient.grpc.aio), as
    `infer` would send it: the result of the response carrying one of `outputs`, the responses before it going to
    on_partial(result). A response's error, and the stream's own gRPC error (UNAVAILABLE when the server is gone),
    raise InferenceServerException as `infer` does; leaving early (cancelled, an error) cancels the stream, and
    with it the request in Triton."""
    import grpc
    from tritonclient.grpc._utils import get_error_grpc
    from tritonclient.utils import InferenceServerException

    wanted = {output.name() for output in outputs}

    async def requests():
        # every output: the messages before the result carry others (STEP, PREVIEW), which asking for `outputs`
        # alone would drop
        yield {"model_name": model_name, "inputs": inputs, "priority": priority, "parameters": parameters}

    responses = client.stream_infer(requests(), stream_timeout=client_timeout)
    try:
        async for result, error in responses:
            if error is not None:
                raise error
            if any(output.name in wanted for output in result.get_response().outputs):
                return result
            on_partial(result)
    except grpc.RpcError as err:
        raise get_error_grpc(err) from None
    finally:
        responses.cancel()  # after the result: a no-op, or the end of a stream whose answer is had
    raise InferenceServerException(f"{model_name}: the stream ended without {', '.join(sorted(wanted))}")


def _client(url: str):
    import tritonclient.grpc.aio as grpc_aio

    from ..triton.client import parse_url

    address, tls = parse_url(url, "grpc")
    return grpc_aio.InferenceServerClient(address, ssl=tls, channel_args=CHANNEL_ARGS)
