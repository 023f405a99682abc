"""The real tritonserver (bundled in nvidia-pytriton) serving a packaged sd15 tiny pipeline.

One server for the module. Images must be bit-identical to the in-process pipeline over the same engines;
bad requests are refused with clear messages and leave the server healthy; cancellation, timeouts and
overload free the instance or are refused fast; the first request after start is as fast as later ones.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton import stage
from trt_diffusion.triton.client import ImageRequest, RequestCancelled, RequestRejected

pytestmark = pytest.mark.triton

PROMPT = "a lighthouse on a cliff at dusk"
SIZE = 64
QUEUE = 8  # max_queue_size of the packaged entry and denoise models
INSTANCES = 2  # of the entry and denoise models (the package default)
LONG_STEPS = 1000  # seconds of work: a request that only cancellation can end early


@dataclass
class Served:
    server: object
    warmup: object
    report: object
    local: object  # the in-process DiffusionPipeline over the same engines
    repo: object

    def url(self, protocol: str) -> str:
        return self.server.http_url if protocol == "http" else self.server.grpc_url


@pytest.fixture(scope="module")
def served(sd15_engines, tmp_path_factory):
    from trt_diffusion.runtime.loader import table_from_engines
    from trt_diffusion.runtime.pipeline import DiffusionPipeline
    from trt_diffusion.triton import stage
    from trt_diffusion.triton.repository import PackageOptions, package

    root = tmp_path_factory.mktemp("triton-serving")
    options = PackageOptions(pipeline_instances=INSTANCES, max_queue_size=QUEUE, queue_timeout_s=60)
    report = package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name,
                     root / "repo", options)
    server, warmup = stage.start(root / "repo", work_dir=root / "work", first_request=True, protocol="grpc")
    local = DiffusionPipeline(sd15_engines.model_dir, sd15_engines.family, table_from_engines(sd15_engines.engines))
    try:
        yield Served(server, warmup, report, local, root / "repo")
    finally:
        server.stop()


def request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=SIZE, width=SIZE, steps=3, guidance_scale=7.5, seed=0)
    values.update(change)
    return ImageRequest(**values)


def remote(served: Served, image_request: ImageRequest, *, protocol: str = "grpc", model: str | None = None,
           timeout_s: float = 120.0) -> np.ndarray:
    module = triton_client.client_module(protocol)
    url = served.url(protocol)
    client = triton_client.connect(url, protocol, timeout_s)
    try:
        return triton_client.infer(client, module, model or served.report.entry, image_request, protocol=protocol,
                                   timeout_s=timeout_s, url=url)
    finally:
        client.close()


def local_image(served: Served, image_request: ImageRequest) -> np.ndarray:
    from trt_diffusion.runtime.pipeline import GenerationRequest

    generation = served.local.generate(GenerationRequest(
        prompt=image_request.prompt, negative_prompt=image_request.negative_prompt, height=image_request.height,
        width=image_request.width, steps=image_request.steps, guidance_scale=image_request.guidance_scale,
        seed=image_request.seed, scheduler=image_request.scheduler or "default"))
    return generation.images[0]


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def steady_latency(served: Served, repeats: int = 5) -> float:
    """Median seconds of a request like the warm-up report's first one (stage.first_requests: same step
    count, open gRPC connection), so the two compare."""
    module = triton_client.client_module("grpc")
    client = triton_client.connect(served.server.grpc_url, "grpc")
    try:
        return statistics.median(timed(triton_client.infer, client, module, served.report.entry,
                                       request(steps=stage.FIRST_REQUEST_STEPS), protocol="grpc",
                                       timeout_s=60)[0] for _ in range(repeats))
    finally:
        client.close()


def timed_request(served: Served, image_request: ImageRequest) -> float:
    """Seconds for one request on a fresh connection, the connection's setup excluded."""
    module = triton_client.client_module("grpc")
    client = triton_client.connect(served.server.grpc_url, "grpc")
    try:
        client.is_server_ready()  # opens the channel
        return timed(triton_client.infer, client, module, served.report.entry, image_request, protocol="grpc",
                     timeout_s=60)[0]
    finally:
        client.close()


def assert_healthy(served: Served) -> None:
    import tritonclient.http as http

    client = http.InferenceServerClient(served.server.http_url)
    try:
        assert client.is_server_live() and client.is_server_ready()
    finally:
        client.close()
    assert remote(served, request(steps=2)).shape == (SIZE, SIZE, 3)


# ---------------------------------------------------------------------------- warm-up


def test_every_model_ready_right_after_server_ready(served):
    assert served.warmup.models_ready and served.warmup.all_ready
    engine_models = {m.name for m in served.report.engine_models()}
    assert engine_models <= set(served.warmup.models_ready)
    assert len(engine_models) == len(served.report.engine_models()) == 4


def test_first_request_is_as_fast_as_steady_state(served):
    first = served.warmup.first_requests
    assert [f.size for f in first] == ["64x64"]
    steady = steady_latency(served)
    # Engine warm-up and the python-side warm-up are what this guards: without them the first request of the
    # tiny model takes hundreds of milliseconds more. (Each python instance still pays ~10 ms once for its
    # first BLS calls, which no warm-up can take: BLS is refused until the server is ready.)
    assert first[0].seconds <= 1.5 * steady, (first[0].seconds, steady)


# ---------------------------------------------------------------------------- images


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("entry", ["entry", "ensemble"])
def test_image_equals_in_process_pipeline(served, protocol, entry):
    model = served.report.entry if entry == "entry" else served.report.ensemble
    image_request = request(seed=11, steps=4, negative_prompt="blurry", scheduler="euler_a")
    image = remote(served, image_request, protocol=protocol, model=model)
    expected = local_image(served, image_request)
    assert image.dtype == np.uint8 and image.shape == (SIZE, SIZE, 3)
    np.testing.assert_array_equal(image, expected)
    assert image.std() > 1  # a real image, not a constant


@pytest.mark.parametrize("entry", ["entry", "ensemble"])
def test_controlnet_image_equals_in_process_pipeline(served, entry):
    from trt_diffusion.runtime.pipeline import GenerationRequest

    model = served.report.entry if entry == "entry" else served.report.ensemble
    control = (np.random.default_rng(0).random((SIZE, SIZE, 3)) * 255).astype(np.uint8)
    image_request = request(seed=5, controlnet="canny", control_image=control, controlnet_scale=0.7)
    image = remote(served, image_request, model=model)
    expected = served.local.generate(GenerationRequest(
        prompt=PROMPT, height=SIZE, width=SIZE, steps=3, seed=5, controlnet="canny", control_image=control,
        controlnet_scale=0.7)).images[0]
    np.testing.assert_array_equal(image, expected)
    assert not np.array_equal(image, local_image(served, request(seed=5)))  # the ControlNet changed the image


def test_generate_finds_the_only_pipeline_and_uses_defaults(served):
    image = triton_client.generate(served.server.http_url, prompt=PROMPT, height=SIZE, width=SIZE, steps=3, seed=2)
    np.testing.assert_array_equal(image, local_image(served, request(steps=3, seed=2)))
    assert triton_client.served_sizes(served.server.http_url) == (served.report.entry, ["64x64"])


def test_generate_command_writes_the_png(served, tmp_path):
    import typer
    from PIL import Image
    from typer.testing import CliRunner

    from trt_diffusion.triton.commands import generate_command

    app = typer.Typer()
    app.command("generate")(generate_command)
    app.command("unused")(lambda: None)
    out = tmp_path / "out.png"
    result = CliRunner().invoke(app, ["generate", "--url", served.server.grpc_url, "--protocol", "grpc",
                                      "--prompt", PROMPT, "--steps", "3", "--seed", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    written = np.asarray(Image.open(out))
    np.testing.assert_array_equal(written, local_image(served, request(steps=3, seed=4)))


# ---------------------------------------------------------------------------- errors


BAD_REQUESTS = [
    (dict(height=96, width=96), "size 96x96 is not served; supported sizes: 64x64"),
    (dict(height=60), "not a positive multiple of 8"),
    (dict(steps=0), "STEPS must be between 1 and 1000, got 0"),
    (dict(steps=10_000), "STEPS must be between 1 and 1000, got 10000"),
    (dict(prompt=""), "PROMPT is empty"),
    (dict(prompt="x" * 10_000), "PROMPT has 10000 characters"),
    (dict(negative_prompt="x" * 20_000), "NEGATIVE_PROMPT has 20000 bytes"),
    (dict(controlnet="canny", control_image=np.zeros((SIZE, SIZE, 3), np.uint8), controlnet_scale=float("nan")),
     "CONTROLNET_SCALE must be in"),
    (dict(scheduler="magic"), "unknown scheduler 'magic'"),
    (dict(guidance_scale=float("nan")), "GUIDANCE_SCALE must be in"),
    (dict(controlnet="depth", control_image=np.zeros((SIZE, SIZE, 3), np.uint8)), "no ControlNet named 'depth'"),
    (dict(controlnet="canny"), "a ControlNet request needs CONTROL_IMAGE"),
    (dict(controlnet="canny", control_image=np.zeros((32, SIZE, 3), np.uint8)), r"CONTROL_IMAGE is \[32, 64, 3\]"),
]


@pytest.mark.parametrize("entry", ["entry", "ensemble"])
@pytest.mark.parametrize("change,message", BAD_REQUESTS, ids=[m.split(";")[0][:30].replace("\\", "")
                                                              for _, m in BAD_REQUESTS])
def test_bad_request_is_a_clear_error_and_server_stays_healthy(served, entry, change, message):
    model = served.report.entry if entry == "entry" else served.report.ensemble
    with pytest.raises(ServeError, match=message) as caught:
        remote(served, request(**change), model=model)
    assert not isinstance(caught.value, (RequestRejected, RequestCancelled))
    assert_healthy(served)


def raw_infer(served: Served, tensors: dict[str, np.ndarray], types: dict[str, str] | None = None):
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(served.server.grpc_url)
    try:
        inputs = []
        for name, value in tensors.items():
            tensor = grpc.InferInput(name, list(value.shape), (types or {}).get(name) or
                                     triton_client._TYPES.get(name, "BYTES"))
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        return client.infer(served.report.entry, inputs)
    finally:
        client.close()


def test_missing_input_is_refused_by_name(served):
    tensors = request().tensors()
    del tensors["PROMPT"]
    with pytest.raises(Exception, match="PROMPT"):
        raw_infer(served, tensors)
    assert_healthy(served)


def test_wrong_dtype_is_refused_by_name(served):
    tensors = request().tensors()
    tensors["STEPS"] = tensors["STEPS"].astype(np.int64)
    with pytest.raises(Exception, match="input 'STEPS' data-type is 'INT64', but model .* expects 'INT32'"):
        raw_infer(served, tensors, {"STEPS": "INT64"})
    assert_healthy(served)


def test_prompt_that_is_not_utf8_is_refused(served):
    tensors = request().tensors()
    tensors["PROMPT"] = np.array([[b"\xff\xfe caf\xe9"]], dtype=object)
    with pytest.raises(Exception, match="PROMPT is not valid UTF-8"):
        raw_infer(served, tensors)
    assert_healthy(served)


# ---------------------------------------------------------------------------- concurrency


def test_concurrent_requests_give_the_images_they_give_alone(served):
    """Multistep scheduler (DPM++ 2M keeps state between steps): no state may leak between requests."""
    requests = [request(seed=100 + i, steps=4, scheduler="dpmpp_2m_karras") for i in range(8)]
    alone = [remote(served, r) for r in requests]
    models = [served.report.entry, served.report.ensemble] * 4  # two processes really run at once
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: remote(served, requests[i], model=models[i]), range(8)))
    for i, (a, b) in enumerate(zip(alone, together)):
        np.testing.assert_array_equal(a, b, err_msg=f"request {i} (seed {requests[i].seed})")
    assert len({a.tobytes() for a in alone}) == 8  # different seeds, different images


# ---------------------------------------------------------------------------- cancellation, timeouts, overload


def test_cancelled_requests_free_their_instances(served):
    """Every instance busy with a 1000-step request; both cancelled; the next request runs at once."""
    import tritonclient.grpc as grpc

    steady = steady_latency(served, 3)
    clients = [grpc.InferenceServerClient(served.server.grpc_url) for _ in range(INSTANCES)]
    errors: list = []
    done = threading.Semaphore(0)

    def callback(result, error):
        errors.append(error)
        done.release()

    inputs = triton_client.make_inputs(grpc, request(steps=LONG_STEPS).tensors())
    futures = [client.async_infer(served.report.entry, inputs, callback=callback) for client in clients]
    time.sleep(0.5)
    for future in futures:
        future.cancel()
    assert all(done.acquire(timeout=10) for _ in futures)
    assert all(error is not None and "cancel" in str(error).lower() for error in errors), errors
    for client in clients:
        client.close()
    after = timed_request(served, request(steps=2))
    # Had the 1000-step requests kept the instances, this one would have waited for them (seconds).
    assert after <= 2 * steady + 0.02, (after, steady)
    assert served.server.log_path.read_text().count("request cancelled after") >= INSTANCES


def test_timed_out_requests_free_their_instances(served):
    """Every instance busy with a 1000-step request whose gRPC deadline passes after 0.5 s."""
    steady = steady_latency(served, 3)

    def long_request(_):
        start = time.perf_counter()
        with pytest.raises(RequestCancelled, match="(?i)deadline"):
            remote(served, request(steps=LONG_STEPS), timeout_s=0.5)
        return time.perf_counter() - start

    with ThreadPoolExecutor(INSTANCES) as pool:
        assert max(pool.map(long_request, range(INSTANCES))) < 2.0
    after = timed_request(served, request(steps=2))
    assert after <= 2 * steady + 0.02, (after, steady)


def test_overload_is_refused_fast_and_nothing_hangs(served):
    """Two instances and a queue of 8: of 16 simultaneous requests, the ones beyond 10 are refused at once."""
    steps, total = 30, 16
    barrier = threading.Barrier(total)

    def one(i: int):
        barrier.wait(10)
        start = time.perf_counter()
        try:
            remote(served, request(seed=i, steps=steps), timeout_s=120)
            return "accepted", time.perf_counter() - start
        except RequestRejected:
            return "rejected", time.perf_counter() - start

    with ThreadPoolExecutor(total) as pool:
        results = list(pool.map(one, range(total)))
    rejected = [s for kind, s in results if kind == "rejected"]
    accepted = [s for kind, s in results if kind == "accepted"]
    assert len(rejected) + len(accepted) == total
    assert len(rejected) >= 3, results
    assert len(accepted) >= QUEUE, results  # the queue really holds QUEUE requests
    assert max(rejected) < 1.0, results  # refused at once, not after a wait
    assert_healthy(served)
