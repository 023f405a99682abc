"""Several Triton replicas behind the API (openai_api/replicas.py): the routing and failover decisions
(ReplicaRouter, pure, on a clock the test moves), then the client over two real gRPC servers (the stand-in Triton of
tests/shared/images_stub_triton.py), one stopped and started again on its port, and the API's online route over
them; and --triton-url's replica list checked by the CLI. Routing by Triton's queue: the metrics parser
(triton_metrics.py) on a body captured from a real tritonserver (triton_metrics_sd15_busy.txt: the tiny sd15's entry
with 4 requests waiting), the router's load figure, and the client and the API reading real HTTP endpoints that serve
that body. The crash of a replica process under a batch is the slow test_replicas_crash.py."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from images_stub_triton import expected_image, start_images_stub

from trt_diffusion.cli import main
from trt_diffusion.openai_api import replicas, triton_metrics
from trt_diffusion.openai_api.replicas import ReplicaClient, ReplicaRouter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_call(router: ReplicaRouter, index: int, unavailable: bool = False) -> None:
    router.started(index)
    router.finished(index, unavailable)


def test_the_ready_replica_with_fewest_calls_in_flight_takes_the_call_ties_in_turn():
    router = ReplicaRouter(["a:1", "b:1", "c:1"], Clock())
    assert [router.pick() for _ in range(4)] == [0, 1, 2, 0]  # idle: in turn
    router.started(1)
    router.started(1)
    router.started(2)
    assert router.pick() == 0  # 0 calls in flight beats 1 and 2
    router.started(0)
    assert router.pick() == 2  # a 1, b 2, c 1 in flight: of the ties a and c, c's turn comes first (after a's)
    assert router.pick() == 0  # then a's
    router.finished(1, False)
    router.finished(1, False)
    assert router.pick() == 1  # b has none in flight now


def test_an_unavailable_replica_is_left_out_then_probed_after_its_back_off():
    clock = Clock()
    router = ReplicaRouter(["a:1", "b:1"], clock)
    run_call(router, 0, unavailable=True)
    assert [r["ready"] for r in router.state()] == [False, True]
    assert {router.pick() for _ in range(5)} == {1}  # every call to b while a is down
    assert router.due_probes() == []  # not before its back-off
    clock.now += replicas.BACKOFF_S
    assert router.due_probes() == [0]
    assert router.due_probes() == []  # one probe at a time
    router.probed(0, ready=False)  # still down: the next probe waits twice as long
    clock.now += replicas.BACKOFF_S
    assert router.due_probes() == []
    clock.now += replicas.BACKOFF_S
    assert router.due_probes() == [0]
    router.probed(0, ready=True)
    assert {router.pick() for _ in range(4)} == {0, 1}  # back in the turn


def test_back_off_stops_doubling_at_its_ceiling():
    clock = Clock()
    router = ReplicaRouter(["a:1", "b:1"], clock)
    run_call(router, 0, unavailable=True)
    for _ in range(10):
        clock.now += replicas.MAX_BACKOFF_S
        assert router.due_probes() == [0]
        router.probed(0, ready=False)
    assert router.replicas[0].backoff_s == replicas.MAX_BACKOFF_S


def test_a_request_error_is_not_a_replica_failure():
    router = ReplicaRouter(["a:1", "b:1"], Clock())
    run_call(router, 0, unavailable=False)  # e.g. INVALID_ARGUMENT, a full queue: the replica answered
    assert router.state()[0]["ready"] and router.state()[0]["served"] == 1


def test_a_call_that_ends_without_an_answer_brings_no_news_of_its_replica():
    """A cancelled or timed-out call (the client went away, a batch cancelled) neither marks a replica down nor, when
    it was a last-resort call to a down one, ready again."""
    router = ReplicaRouter(["a:1", "b:1"], Clock())
    run_call(router, 0, unavailable=True)
    router.started(0)
    router.finished(0, unavailable=False, answered=False)
    assert router.state()[0]["ready"] is False and router.state()[0]["in_flight"] == 0
    router.started(1)
    router.finished(1, unavailable=False, answered=False)
    assert router.state()[1] == {"url": "b:1", "ready": True, "in_flight": 0, "queue": None, "metrics": None,
                                 "metrics_error": None, "served": 0, "failures": 0}


def test_a_full_queue_is_the_replica_answering_not_a_replica_failure():
    """Triton answers a full queue and a queue timeout with gRPC UNAVAILABLE, as a server that is not there: its
    words tell them apart (the API's 429, never retried on another replica)."""
    from tritonclient.utils import InferenceServerException

    def error(message: str, status: str = "StatusCode.UNAVAILABLE"):
        return InferenceServerException(msg=message, status=status)

    assert replicas.is_unavailable(error("failed to connect to all addresses; last error: UNKNOWN: Connection refused"))
    assert replicas.is_unavailable(error("Socket closed"))
    assert not replicas.is_unavailable(error("sd15-tiny: Exceeds maximum queue size"))
    assert not replicas.is_unavailable(error("Request timeout expired"))
    assert not replicas.is_unavailable(error("unexpected shape", "StatusCode.INVALID_ARGUMENT"))
    assert not replicas.is_unavailable(ValueError("not Triton's"))


def test_with_none_ready_a_call_tries_the_replica_due_first_then_another_then_gives_up():
    clock = Clock()
    router = ReplicaRouter(["a:1", "b:1"], clock)
    run_call(router, 1, unavailable=True)
    clock.now += 0.5
    run_call(router, 0, unavailable=True)  # b's back-off ends first
    assert router.pick() == 1
    assert router.pick(frozenset({1})) == 0
    assert router.pick(frozenset({0, 1})) is None
    run_call(router, 0, unavailable=False)  # a last-resort call that a answered: a is ready again
    assert router.pick() == 0


LORA_SETS = [f'[{{"name":"style{i}","scale":0.{i % 9 + 1}}}]' for i in range(40)]


def test_a_lora_set_goes_to_the_replica_it_hashes_to_call_after_call():
    router = ReplicaRouter(["a:1", "b:1", "c:1"], Clock())
    chosen = {key: router.pick(lora_key=key) for key in LORA_SETS}
    assert set(chosen.values()) == {0, 1, 2}  # the sets spread over every replica
    for _ in range(3):  # the same set: the same replica, whatever else ran meanwhile (no turn, no in-flight tie)
        router.pick()
        assert {key: router.pick(lora_key=key) for key in LORA_SETS} == chosen
    # and in another process: the hash is of the replica's URL and the set, nothing of this router's
    assert {key: ReplicaRouter(["c:1", "a:1", "b:1"], Clock()).pick(lora_key=key) for key in LORA_SETS} == {
        key: (index + 1) % 3 for key, index in chosen.items()}


def test_losing_a_replica_moves_only_its_sets_and_adding_one_moves_only_what_it_wins():
    clock = Clock()
    urls = ["a:1", "b:1", "c:1"]
    router = ReplicaRouter(urls, clock)
    before = {key: urls[router.pick(lora_key=key)] for key in LORA_SETS}
    run_call(router, 1, unavailable=True)  # b is down
    after = {key: urls[router.pick(lora_key=key)] for key in LORA_SETS}
    assert "b:1" not in after.values()
    assert {key for key in LORA_SETS if after[key] != before[key]} == {k for k, url in before.items() if url == "b:1"}
    # the retry of a call whose replica failed goes where the set goes while that replica is down
    assert all(urls[router.pick(frozenset({urls.index(before[key])}), key)] == after[key]
               for key in LORA_SETS if before[key] == "b:1")

    grown = ReplicaRouter([*urls, "d:1"], clock)
    added = {key: grown.replicas[grown.pick(lora_key=key)].url for key in LORA_SETS}
    moved = {key for key in LORA_SETS if added[key] != before[key]}
    assert moved and all(added[key] == "d:1" for key in moved)  # only to the new replica


def test_a_saturated_lora_replica_gives_way_to_the_least_loaded_and_no_loras_goes_by_load():
    router = ReplicaRouter(["a:1", "b:1", "c:1"], Clock())
    key = LORA_SETS[0]
    home = router.pick(lora_key=key)
    others = [i for i in range(3) if i != home]
    for _ in range(replicas.SATURATED_MARGIN):
        router.started(home)
    assert router.pick(lora_key=key) == home  # 2 above the least-loaded: still its own
    router.started(home)
    assert router.pick(lora_key=key) in others  # 3 above: the least-loaded takes it
    router.started(others[0])
    assert router.pick(lora_key=key) == others[1]  # the least-loaded of the others
    router.finished(home, False)
    assert router.pick(lora_key=key) == home  # back within the margin (2 above the least: 2 vs 0)
    assert router.pick() == others[1]  # no LoRAs: fewest in flight, as always


def test_the_lora_key_is_the_canonical_set_read_from_the_request_s_inputs():
    import tritonclient.grpc.aio as grpc_aio

    from trt_diffusion.triton.client import ImageRequest, make_inputs

    def key(loras):
        return replicas.lora_key(make_inputs(grpc_aio, ImageRequest("p", 64, 64, seed=1, loras=loras).tensors()))

    assert key('[{"name":"b","scale":0.5},{"name":"a","scale":1.0}]') == key(
        '[{"name": "a", "scale": 1}, {"name": "b", "scale": 0.50}]') == '[{"name":"a","scale":1.0},{"name":"b","scale":0.5}]'
    assert key(None) is None and key("[]") is None  # no LoRAs: by load
    assert key('[{"name":"a","scale":0.0}]') is None  # scale 0: the base model
    assert key("not json") is None  # the entry refuses it; routed by load


def test_the_client_sends_a_lora_set_s_requests_to_one_replica_over_grpc():
    """Real gRPC, the job runner's client included (BatchPriorityClient): a LoRA set's requests all reach one
    replica, the requests without LoRAs are spread over both."""
    import tritonclient.grpc.aio as grpc_aio

    from trt_diffusion.openai_api.job_slots import BatchPriorityClient
    from trt_diffusion.triton.client import ImageRequest, make_inputs

    stubs = [start_images_stub(), start_images_stub()]

    async def scenario():
        client = ReplicaClient([stubs[0].url, stubs[1].url], Clock())
        try:
            for i in range(6):
                request = ImageRequest(f"p{i}", 64, 64, steps=2, seed=i, loras='[{"name":"style","scale":0.8}]')
                await (client if i % 2 else BatchPriorityClient(client)).infer(
                    "sd15-tiny", make_inputs(grpc_aio, request.tensors()))
            assert sorted(len(s.infers) for s in stubs) == [0, 6]
            for i in range(4):
                await client.infer("sd15-tiny", make_inputs(grpc_aio, ImageRequest("q", 64, 64, seed=i).tensors()))
            assert sorted(len(s.infers) for s in stubs) == [2, 8]
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        for stub in stubs:
            stub.stop()


def test_the_client_fails_over_and_takes_a_restarted_replica_back():
    """Real gRPC: a replica stopped mid-run costs no call (each retried once on the other), is left out, and is
    used again once a probe after its back-off finds it started again on its port."""
    from tritonclient.utils import InferenceServerException

    from trt_diffusion.triton.client import ImageRequest, make_inputs

    stubs = [start_images_stub(), start_images_stub()]
    clock = Clock()

    async def infer(client, prompt: str, seed: int, **changes):
        import tritonclient.grpc.aio as grpc_aio

        tensors = ImageRequest(prompt, 64, 64, steps=2, seed=seed).tensors()
        for name in changes.get("drop", ()):
            tensors.pop(name)
        result = await client.infer("sd15-tiny", make_inputs(grpc_aio, tensors))
        return result.as_numpy("IMAGE")[0]

    async def scenario():
        client = ReplicaClient([stubs[0].url, stubs[1].url], clock)
        try:
            for i in range(4):
                assert np.array_equal(await infer(client, f"p{i}", i), expected_image("sd15-tiny", f"p{i}", i, 64,
                                                                                      64, 2))
            assert [len(s.infers) for s in stubs] == [2, 2]  # spread in turn

            port = int(stubs[0].url.rpartition(":")[2])
            stubs[0].stop()  # replica a goes away
            for i in range(4, 8):
                assert np.array_equal(await infer(client, f"p{i}", i), expected_image("sd15-tiny", f"p{i}", i, 64,
                                                                                      64, 2))
            assert [len(s.infers) for s in stubs] == [2, 6]
            assert client.state()[0]["ready"] is False and client.state()[0]["failures"] == 1  # one retried call

            # a request's own error (the stub breaks on a request without SEED) is not retried nor a failure
            with pytest.raises(InferenceServerException) as refused:
                await infer(client, "no seed", 0, drop=("SEED",))
            assert "UNAVAILABLE" not in str(refused.value.status())
            assert client.state()[1]["ready"] is True and client.state()[1]["failures"] == 0

            stubs[0] = start_images_stub(port)  # a started again on its port
            await client.is_server_live()  # a call before the back-off: no probe yet
            await asyncio.sleep(0.1)
            assert client.state()[0]["ready"] is False
            clock.now += replicas.BACKOFF_S
            await client.is_server_live()  # starts the probe
            for _ in range(100):
                if client.state()[0]["ready"]:
                    break
                await asyncio.sleep(0.05)
            assert client.state()[0]["ready"] is True
            for i in range(8, 12):
                await infer(client, f"p{i}", i)
            assert len(stubs[0].infers) == 2  # a answers again

            for stub in stubs:  # none left: the caller gets UNAVAILABLE (the API's 503), after two tries
                stub.stop()
            with pytest.raises(InferenceServerException) as gone:
                await infer(client, "none left", 1)
            assert "UNAVAILABLE" in str(gone.value.status())
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        for stub in stubs:
            stub.stop()


def test_the_online_route_answers_from_the_replica_left(tmp_path):
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings

    stubs = [start_images_stub(), start_images_stub()]
    try:
        settings = ApiSettings(f"{stubs[0].url},{stubs[1].url}", port=0, state_dir=tmp_path / "state")
        with ApiServer(settings) as api:
            def generate(prompt: str, seed: int) -> np.ndarray:
                from PIL import Image

                body = json.dumps({"model": "sd15-tiny", "prompt": prompt, "seed": seed,
                                   "num_inference_steps": 2}).encode()
                request = urllib.request.Request(api.url + "/images/generations", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    item = json.loads(response.read())["data"][0]
                with Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) as image:
                    return np.asarray(image.convert("RGB"))

            generate("warm", 1)
            stubs[1].stop()
            for i in range(4):
                assert np.array_equal(generate(f"q{i}", i), expected_image("sd15-tiny", f"q{i}", i, 64, 64, 2))
            with urllib.request.urlopen(api.url.removesuffix("/v1") + "/health", timeout=10) as response:
                health = json.loads(response.read())
            assert [r["url"] for r in health["replicas"]] == [stubs[0].url, stubs[1].url]
            assert health["replicas"][1]["ready"] is False
    finally:
        for stub in stubs:
            stub.stop()


def run_cli(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


@pytest.mark.parametrize("urls, fragment", [
    (["127.0.0.1:8001,ftp://127.0.0.1:8002"], "--triton-url ftp://127.0.0.1:8002: unknown scheme ftp://"),
    (["127.0.0.1:8001", "grpc://10.0.0.2"], "--triton-url grpc://10.0.0.2: not a gRPC address; give host:port"),
    (["127.0.0.1:8001", "grpc://127.0.0.1:8001"], "--triton-url 127.0.0.1:8001 is given twice"),
    (["127.0.0.1:8001,,127.0.0.1:8002"], None),  # an empty item of a comma list is skipped, like --allowed-hosts'
])
def test_a_bad_replica_address_is_refused_naming_the_option(urls, fragment, capsys, tmp_path):
    import socket

    argv = ["openai-api", "--state-dir", str(tmp_path / "state")]
    for url in urls:
        argv += ["--triton-url", url]
    with socket.socket() as taken:  # a good list gets as far as listening: on a port taken here, it stops there
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, text = run_cli([*argv, "--port", str(taken.getsockname()[1])], capsys)
    assert code == 1 and "Traceback" not in text, text
    if fragment is None:
        assert "cannot listen on" in text and "(Triton 127.0.0.1:8001, 127.0.0.1:8002;" in text, text
    else:
        assert fragment in text, text


# Routing by Triton's queue (its metrics)

METRICS_BODY = (Path(__file__).parent / "triton_metrics_sd15_busy.txt").read_text()
ENTRY_PENDING = 'nv_inference_pending_request_count{model="sd15-tiny",version="1"} 4'


def test_triton_s_metrics_give_each_model_s_queue():
    """The body a real tritonserver (nvidia-pytriton's 2.51) served while the tiny sd15's entry had 4 requests
    waiting for its 2 instances: every sample parses (counters, gauges, the project's histograms with le="+Inf"),
    and the queue is the entry's 4, the engine and stream models' 0."""
    sample_lines = [line for line in METRICS_BODY.splitlines() if line and not line.startswith("#")]
    parsed = list(triton_metrics.samples(METRICS_BODY))
    assert len(parsed) == len(sample_lines) > 100
    assert ("trt_diffusion_queue_wait_seconds_bucket", {"le": "+Inf", "model": "sd15-tiny"}, 4.0) in [
        (name, {k: v for k, v in labels.items() if k in ("le", "model")}, value) for name, labels, value in parsed
        if name == "trt_diffusion_queue_wait_seconds_bucket" and labels.get("le") == "+Inf"]
    assert triton_metrics.pending_requests(METRICS_BODY) == {
        "sd15-tiny": 4, "sd15-tiny_stream": 0, "sd15-tiny__text_encoder__any__b1": 0, "sd15-tiny__unet__64x64__b2": 0,
        "sd15-tiny__vae_decoder__64x64__b1": 0, "sd15-tiny__controlnet__canny__64x64__b2": 0}
    # the text format's other forms: escaped label values, a timestamp, versions of one model summed
    assert triton_metrics.pending_requests(
        '# TYPE nv_inference_pending_request_count gauge\n'
        'nv_inference_pending_request_count{model="a\\"b\\\\c",version="1"} 2 1712000000000\n'
        'nv_inference_pending_request_count{model="m",version="1"} 1\n'
        'nv_inference_pending_request_count{model="m",version="2",} 3\n') == {'a"b\\c': 2, "m": 4}
    with pytest.raises(triton_metrics.MetricsError, match="no nv_inference_pending_request_count"):
        triton_metrics.pending_requests(METRICS_BODY.replace("nv_inference_pending", "nv_other_pending"))
    with pytest.raises(triton_metrics.MetricsError, match="not Prometheus text"):
        triton_metrics.pending_requests("# HELP x\n<html>not found</html>\n")


@pytest.mark.parametrize("given, url", [
    ("10.0.0.2", "http://10.0.0.2:8002/metrics"),  # Triton's metrics port and path by default
    ("triton-0.example.com:9102", "http://triton-0.example.com:9102/metrics"),
    ("https://triton-0.example.com/prometheus/", "https://triton-0.example.com:8002/prometheus"),
    ("http://[::1]:8002/metrics", "http://[::1]:8002/metrics"),
])
def test_a_metrics_address_is_completed_with_triton_s_port_and_path(given, url):
    assert triton_metrics.metrics_url(given) == url


def scraped_router(queues, clock=None) -> ReplicaRouter:
    router = ReplicaRouter([f"{name}:1" for name in "abc"[:len(queues)]], clock or Clock(),
                           [f"{name}:8002" for name in "abc"[:len(queues)]])
    for index, queue in enumerate(queues):
        router.scraped(index, queue)
    return router


def test_a_replica_with_a_deep_triton_queue_loses_to_an_idle_one():
    """Nothing of this API in flight to either: Triton's queue (other clients' requests) decides; this API's calls in
    flight add to it (they cover the time between readings)."""
    router = scraped_router([5, 0])
    assert [router.pick() for _ in range(3)] == [1, 1, 1]
    for _ in range(5):
        router.started(1)
    assert [router.pick() for _ in range(2)] == [0, 1]  # 5 queued vs 5 in flight: a tie, taken in turn
    router.started(1)
    assert router.pick() == 0  # 6 in flight beats 5 queued
    router.scraped(0, 9)
    assert router.pick() == 1  # the next reading: 9 queued there now
    assert [r["queue"] for r in router.state()] == [9, 0] and router.load(1) == 6


def test_a_lora_set_s_replica_with_a_deep_triton_queue_is_saturated():
    router = scraped_router([0, 0, 0])
    key = LORA_SETS[0]
    home = router.pick(lora_key=key)
    router.scraped(home, replicas.SATURATED_MARGIN)
    assert router.pick(lora_key=key) == home  # its queue within the margin of the least-loaded: still its own
    router.scraped(home, replicas.SATURATED_MARGIN + 1)
    assert router.pick(lora_key=key) != home  # Triton's queue alone saturates it, nothing of this API in flight
    router.scraped(home, 0)
    assert router.pick(lora_key=key) == home


def test_a_failed_or_stale_reading_falls_back_to_the_api_s_own_count():
    clock = Clock()
    router = scraped_router([7, 0], clock)
    assert router.pick() == 1
    router.scrape_failed(0, "Connection refused")  # not a failure of the replica: it stays ready, in the turn
    assert [router.pick() for _ in range(4)] == [0, 1, 0, 1]
    assert router.state()[0]["ready"] is True and router.state()[0]["queue"] is None
    assert router.state()[0]["metrics_error"] == "Connection refused"
    router.scraped(0, 7)
    assert router.pick() == 1 and router.state()[0]["metrics_error"] is None
    clock.now += replicas.METRICS_MAX_AGE_S + 1  # no reading since (its poll stalled): the old figures no longer count
    assert [router.pick() for _ in range(2)] == [0, 1]
    assert router.state()[0]["queue"] is None and router.state()[0]["metrics_error"] == "the last reading is 6 s old"
    router.scraped(0, 7)
    run_call(router, 0, unavailable=True)  # a replica marked down forgets its queue: read again once it is back
    assert router.replicas[0].queue is None


class MetricsEndpoint:
    """A Triton metrics endpoint on loopback (real HTTP) serving the body captured from tritonserver, with the
    entry's pending count set by the test; `status` other than 200: that error instead."""

    def __init__(self, pending: int = 0):
        self.pending, self.status = pending, 200
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path != "/metrics" or endpoint.status != 200:
                    self.send_error(404 if self.path != "/metrics" else endpoint.status)
                    return
                body = METRICS_BODY.replace(ENTRY_PENDING, ENTRY_PENDING[:-1] + str(endpoint.pending)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"127.0.0.1:{self.server.server_address[1]}"  # as --triton-metrics-url takes it
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_api_sends_requests_to_the_replica_whose_triton_queue_is_shorter_and_health_shows_it(tmp_path):
    """Real gRPC and HTTP: replica a's Triton says 6 requests wait, b's none; the API, which has nothing in flight to
    either, sends every request to b, and /health shows each replica's queue and metrics address."""
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings

    stubs = [start_images_stub(), start_images_stub()]
    endpoints = [MetricsEndpoint(pending=6), MetricsEndpoint(pending=0)]
    try:
        settings = ApiSettings(f"{stubs[0].url},{stubs[1].url}", triton_metrics_urls=tuple(e.url for e in endpoints),
                               port=0, state_dir=tmp_path / "state")
        with ApiServer(settings) as api:
            def health() -> dict:
                with urllib.request.urlopen(api.url.removesuffix("/v1") + "/health", timeout=10) as response:
                    return json.loads(response.read())

            deadline = time.monotonic() + 10
            while [r["queue"] for r in health()["replicas"]] != [6, 0] and time.monotonic() < deadline:
                time.sleep(0.05)
            replica_list = health()["replicas"]
            assert [(r["queue"], r["metrics"], r["metrics_error"]) for r in replica_list] == [
                (6, f"http://{endpoints[0].url}/metrics", None), (0, f"http://{endpoints[1].url}/metrics", None)]
            for seed in range(3):
                body = json.dumps({"model": "sd15-tiny", "prompt": "p", "seed": seed,
                                   "num_inference_steps": 2}).encode()
                request = urllib.request.Request(api.url + "/images/generations", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    assert response.status == 200
            assert [len(stub.infers) for stub in stubs] == [0, 3]
    finally:
        for stub in stubs:
            stub.stop()
        for endpoint in endpoints:
            endpoint.stop()


def test_a_replica_whose_metrics_fail_stays_ready_and_is_routed_by_the_api_s_calls():
    """Real gRPC and HTTP: a's metrics answer HTTP 500, then its endpoint is gone (connection refused); a stays
    ready, its queue unknown, and the client's calls go to both replicas in turn as without metrics."""
    from trt_diffusion.triton.client import ImageRequest, make_inputs

    stubs = [start_images_stub(), start_images_stub()]
    endpoints = [MetricsEndpoint(pending=0), MetricsEndpoint(pending=0)]

    async def wait_for(client, check) -> list[dict]:
        for _ in range(200):
            if check(client.state()):
                break
            await asyncio.sleep(0.02)
        return client.state()

    async def scenario():
        import tritonclient.grpc.aio as grpc_aio

        client = ReplicaClient([stubs[0].url, stubs[1].url], Clock(), metrics_urls=[
            triton_metrics.metrics_url(e.url) for e in endpoints], metrics_every_s=0.02).start()
        try:
            async def infer(count: int) -> None:
                for i in range(count):
                    await client.infer("sd15-tiny", make_inputs(grpc_aio, ImageRequest("p", 64, 64, seed=i).tensors()))

            endpoints[0].status = 500
            state = await wait_for(client, lambda s: s[0]["metrics_error"] and s[1]["queue"] == 0)
            assert state[0]["metrics_error"].startswith("HTTP 500") and state[0]["queue"] is None
            endpoints[1].pending = 5  # b's queue is 5; a's is not known, so a is loaded by this API's calls alone
            await wait_for(client, lambda s: s[1]["queue"] == 5)
            await infer(2)
            assert [len(stub.infers) for stub in stubs] == [2, 0]
            endpoints[1].pending = 0
            endpoints[0].stop()  # no endpoint at all now
            state = await wait_for(client, lambda s: s[1]["queue"] == 0 and "refused" in (s[0]["metrics_error"] or ""))
            assert "Connection refused" in state[0]["metrics_error"], state
            await infer(4)
            assert [len(stub.infers) for stub in stubs] == [4, 2]  # in turn, as without metrics
            assert [r["ready"] for r in client.state()] == [True, True]
            assert [r["failures"] for r in client.state()] == [0, 0]
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        for stub in stubs:
            stub.stop()
        endpoints[1].stop()


@pytest.mark.parametrize("metrics, fragment", [
    (["127.0.0.1:8002"], "--triton-metrics-url gives 1 address for 2 --triton-url replicas: give one per replica, "
                         "in --triton-url's order"),
    (["127.0.0.1:8002,127.0.0.1:8012,127.0.0.1:8022"], "--triton-metrics-url gives 3 addresses for 2"),
    (["127.0.0.1:8002", "grpc://127.0.0.1:8012"], "--triton-metrics-url 'grpc://127.0.0.1:8012': unknown scheme "
                                                  "grpc://"),
    (["127.0.0.1", "http://127.0.0.1:8002/metrics"], "--triton-metrics-url http://127.0.0.1:8002/metrics is given "
                                                     "twice"),
    (["127.0.0.1:8002", "127.0.0.1:8012"], None),  # one each: as far as listening, the start line naming them
])
def test_metrics_addresses_are_one_per_replica_or_refused_naming_the_option(metrics, fragment, capsys, tmp_path):
    import socket

    argv = ["openai-api", "--state-dir", str(tmp_path / "state"), "--triton-url", "127.0.0.1:8001,127.0.0.1:8011"]
    for url in metrics:
        argv += ["--triton-metrics-url", url]
    with socket.socket() as taken:  # a good list gets as far as listening: on a port taken here, it stops there
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, text = run_cli([*argv, "--port", str(taken.getsockname()[1])], capsys)
    assert code == 1 and "Traceback" not in text, text
    if fragment is None:
        assert "cannot listen on" in text and ("(Triton 127.0.0.1:8001, 127.0.0.1:8011, metrics "
                                               "http://127.0.0.1:8002/metrics, http://127.0.0.1:8012/metrics;") in text
    else:
        assert fragment in text and "cannot listen" not in text, text


def test_serve_gives_the_api_each_replica_s_metrics_port(monkeypatch):
    """`serve --replicas N --openai-port`: the API reads each replica's queue from the metrics port serve started it
    with; with --no-triton-http (no metrics port) it reads none."""
    from types import SimpleNamespace

    from trt_diffusion import api as api_module
    from trt_diffusion.openai_api import server as api_server
    from trt_diffusion.openai_api.settings import ApiSettings
    from trt_diffusion.triton import stage

    fronted = []

    class Api:
        def __init__(self, settings):
            fronted.append((settings.triton_url, settings.triton_metrics_urls))

        def start(self):
            return self

        def stop(self):
            pass

    def reports(metrics):
        return [SimpleNamespace(grpc_url=f"127.0.0.1:900{i}", metrics_url=url) for i, url in enumerate(metrics)]

    monkeypatch.setattr(api_server, "ApiServer", Api)
    for metrics in (["http://127.0.0.1:9100/metrics", "http://127.0.0.1:9101/metrics"], ["", ""]):
        monkeypatch.setattr(stage, "serve", lambda repo, on_ready, metrics=metrics, **options: on_ready(
            reports(metrics)))
        api_module.serve("repo", openai=ApiSettings("unused:1", port=0), replicas=2)
    assert fronted == [("127.0.0.1:9000,127.0.0.1:9001", ("http://127.0.0.1:9100/metrics",
                                                          "http://127.0.0.1:9101/metrics")),
                       ("127.0.0.1:9000,127.0.0.1:9001", ())]
