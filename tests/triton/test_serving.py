"""The real tritonserver (bundled in nvidia-pytriton) serving a packaged sd15 tiny pipeline.

One server for the module. Images must be bit-identical to the in-process pipeline over the same engines;
bad requests are refused with clear messages and leave the server healthy (every refusal the request reader
and the pipeline make is a unit test in test_request_parsing.py; a few go through the server here);
cancellation and deadlines stop the denoising loop and free the instance; a request that finds the queue
full is refused while the instances are still busy; every model is warmed up before the server is ready.

No latency is a pass/fail threshold: the tests assert events, read from Triton's statistics (engine calls
per model), its pending-request metric and its log. Waits for an event have a hang guard only.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import client as triton_client
from trt_diffusion.triton import stage
from trt_diffusion.triton.client import ImageRequest, RequestRejected
from trt_diffusion.triton.validate import read_configs

pytestmark = pytest.mark.triton

PROMPT = "a lighthouse on a cliff at dusk"
SIZE = 64
QUEUE = 8  # max_queue_size of the packaged entry and denoise models
INSTANCES = 2  # of the entry and denoise models (the package default)
LONG_STEPS = 1000  # seconds of work: a request that only cancellation can end early
HANG_GUARD_S = 120  # how long a wait for an event may take before the test fails: a hang, not a latency
CANCELLED_LINE = "request cancelled after"  # what a pipeline model logs when it stops a request


@dataclass
class Served:
    server: object
    warmup: object
    report: object
    local: object  # the in-process EnginePipeline over the same engines
    repo: object

    def url(self, protocol: str) -> str:
        return self.server.http_url if protocol == "http" else self.server.grpc_url


@pytest.fixture(scope="module")
def served(sd15_engines, tmp_path_factory):
    from trt_diffusion.runtime.loader import table_from_engines
    from trt_diffusion.runtime.pipeline import EnginePipeline
    from trt_diffusion.triton.repository import PackageOptions, package

    root = tmp_path_factory.mktemp("triton-serving")
    options = PackageOptions(pipeline_instances=INSTANCES, max_queue_size=QUEUE, queue_timeout_s=60)
    report = package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name,
                     root / "repo", options)
    server, warmup = stage.start(root / "repo", work_dir=root / "work", first_request=True, protocol="grpc")
    local = EnginePipeline(sd15_engines.model_dir, sd15_engines.family, table_from_engines(sd15_engines.engines))
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


def wait_for(condition, what: str, served: Served | None = None) -> None:
    """Poll until `condition()` holds; fail after HANG_GUARD_S (the event never came: a hang, not slowness),
    with the server log's tail when given the server."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        if time.monotonic() > deadline:
            tail = f"\nserver log:\n{served.server.log_tail(40)}" if served else ""
            pytest.fail(f"{what}: did not happen within {HANG_GUARD_S} s{tail}")
        time.sleep(0.02)


def engine_model(served: Served, component: str) -> str:
    (name,) = [m.name for m in served.report.engine_models() if m.component == component]
    return name


def engine_calls(served: Served, component: str) -> int:
    """Requests the component's engine model has answered (Triton's statistics: BLS calls included)."""
    import tritonclient.http as http

    client = http.InferenceServerClient(served.server.http_url)
    try:
        (stats,) = client.get_inference_statistics(engine_model(served, component))["model_stats"]
    finally:
        client.close()
    return int(stats["inference_count"])


def pending_requests(served: Served, model: str) -> int:
    """Requests waiting in the model's queue now (Triton's nv_inference_pending_request_count)."""
    url = f"http://127.0.0.1:{served.server.ports.metrics}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf'^nv_inference_pending_request_count{{model="{re.escape(model)}",version="1"}} (\d+)', text,
                      re.MULTILINE)
    assert match, f"no pending-request metric for {model}"
    return int(match.group(1))


def cancelled_in_log(served: Served) -> int:
    return served.server.log_path.read_text(errors="replace").count(CANCELLED_LINE)


class LongRequests:
    """One 1000-step ControlNet request per instance of the entry (a ControlNet and a UNet call per step:
    seconds of work), sent asynchronously over gRPC one after another: each is sent once the previous one has
    started, i.e. has run its text encoder (each request calls it exactly twice: prompt and negative prompt).
    The entry batches requests (one execute takes up to 8 and runs those it cannot share denoiser calls for one
    after another); sent together, two long requests can land in one execute while the other instance idles.
    Sent this way, each finds the instances before it busy and takes a free one."""

    def __init__(self, served: Served, count: int = INSTANCES, timeout_s: float | None = None):
        import tritonclient.grpc as grpc

        self.served, self.count = served, count
        self.text_calls = engine_calls(served, "text_encoder")
        self.clients = [grpc.InferenceServerClient(served.server.grpc_url) for _ in range(count)]
        self.errors: list = []
        self.results: list = []
        self.done = threading.Semaphore(0)
        control = np.zeros((SIZE, SIZE, 3), np.uint8)
        inputs = triton_client.make_inputs(grpc, request(steps=LONG_STEPS, controlnet="canny",
                                                         control_image=control).tensors())
        kwargs = {} if timeout_s is None else {"client_timeout": timeout_s}
        self.futures = []
        for index, client in enumerate(self.clients):
            self.futures.append(client.async_infer(served.report.entry, inputs, callback=self._callback, **kwargs))
            wait_for(lambda: self._started(index + 1), f"long request {index + 1} running", served)

    def _started(self, count: int) -> bool:
        return engine_calls(self.served, "text_encoder") >= self.text_calls + 2 * count

    def _callback(self, result, error) -> None:
        (self.errors if error is not None else self.results).append(error or result)
        self.done.release()

    def finished(self) -> int:
        return len(self.errors) + len(self.results)

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()

    def wait(self) -> None:
        assert all(self.done.acquire(timeout=HANG_GUARD_S) for _ in self.futures), "a long request never ended"
        for client in self.clients:
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


def test_every_model_is_warmed_up_before_the_server_is_ready(served):
    """What makes a first request as fast as later ones, as events: every engine model carries its warm-up
    samples (Triton runs them before the model is ready, and the server starts with strict readiness), and
    every instance of every pipeline model ran its in-process warm-up in `initialize`, before ready."""
    configs = read_configs(served.repo)
    log = served.server.log_path.read_text(errors="replace")
    for model in served.report.models:
        config = configs[model.name]
        if model.role == "engine":
            assert model.warmup_samples > 0 and len(config.model_warmup) == model.warmup_samples, model.name
        elif model.backend == "python":
            instances = sum(group.count for group in config.instance_group)
            assert log.count(f"{model.name}: python warm-up took") == instances, model.name
    # the first request after ready was served (its latency is recorded for the report, not judged here)
    assert [f.size for f in served.warmup.first_requests] == ["64x64"]


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

    from trt_diffusion.cli.serve_commands import generate_command

    app = typer.Typer()
    app.command("generate")(generate_command)
    app.command("unused")(lambda: None)
    out = tmp_path / "out.png"
    result = CliRunner().invoke(app, ["generate", "--url", served.server.grpc_url, "--protocol", "grpc",
                                      "--prompt", PROMPT, "--steps", "3", "--seed", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    written = np.asarray(Image.open(out))
    np.testing.assert_array_equal(written, local_image(served, request(steps=3, seed=4)))


def _cli(*argv: str):
    """The whole command line in process (main: argv parsing and exit codes)."""
    from trt_diffusion.cli import main

    return main(list(argv))


def test_guidance_1_runs_without_cfg_on_the_batch_2_engines(served):
    # the default build is `cfg: batched` (UNet batch 2 only): a no-CFG request runs on it, padded
    image_request = request(seed=3, guidance_scale=1.0)
    image = remote(served, image_request)
    np.testing.assert_array_equal(image, local_image(served, image_request))
    assert not np.array_equal(image, local_image(served, request(seed=3)))  # CFG off changed the image


def test_generate_writes_its_request_into_the_png_and_repeats_it(served, tmp_path, capsys):
    from PIL import Image

    from trt_diffusion.image_files import read_png_parameters

    out = tmp_path / "out.png"
    # the URL's scheme chooses gRPC (no --protocol)
    assert _cli("generate", "--url", f"grpc://{served.server.grpc_url}", "--prompt", PROMPT, "--steps", "3",
                "--seed", "6", "--negative-prompt", "fog", "-o", str(out)) == 0
    with Image.open(out) as image:
        text = image.text
    assert text["parameters"].splitlines()[0] == PROMPT and "Negative prompt: fog" in text["parameters"]
    assert "Steps: 3" in text["parameters"] and "Seed: 6" in text["parameters"] and "Size: 64x64" in text["parameters"]
    recorded = read_png_parameters(out)
    assert (recorded.prompt, recorded.seed, recorded.steps, recorded.model) == (PROMPT, 6, 3, served.report.entry)
    # the same command again does not overwrite: a numbered name; --from repeats the request exactly
    assert _cli("generate", "--url", served.server.http_url, "--from", str(out), "-o", str(out)) == 0
    again = tmp_path / "out-0001.png"
    np.testing.assert_array_equal(np.asarray(Image.open(again)), np.asarray(Image.open(out)))
    # options given beside --from win
    assert _cli("generate", "--url", served.server.http_url, "--from", str(out), "--seed", "7", "-o", str(out)) == 0
    assert read_png_parameters(tmp_path / "out-0002.png").seed == 7
    assert _cli("generate", "--url", served.server.http_url, "--from", str(out), "--overwrite", "-o", str(out)) == 0
    assert not (tmp_path / "out-0003.png").exists()


@pytest.mark.parametrize("protocol,port", [("http", "grpc"), ("grpc", "http")])
def test_a_client_on_the_wrong_port_is_told_so(served, protocol, port, capsys):
    address = served.url(port)
    assert _cli("generate", "--url", address, "--protocol", protocol, "--prompt", PROMPT, "--timeout", "20") == 1
    err = " ".join(capsys.readouterr().err.split())
    expected = "gRPC port (8001 by default)" if port == "grpc" else "HTTP port (8000 by default)"
    assert expected in err and "Traceback" not in err, err


def test_unknown_pipeline_and_controlnet_names_list_what_is_served(served, capsys):
    assert _cli("generate", "--url", served.server.http_url, "--pipeline", "nope", "--prompt", PROMPT) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"serves no pipeline 'nope'; it serves: {served.report.entry}" in err, err
    control = np.zeros((SIZE, SIZE, 3), np.uint8)
    with pytest.raises(ServeError, match=r"no ControlNet named 'depth' is served \(served: canny\)"):
        remote(served, request(controlnet="depth", control_image=control))


# ---------------------------------------------------------------------------- errors


# One refusal per place that refuses, end to end (every case is a unit test in test_request_parsing.py): the
# request reader (bytes before decoding), the pipeline's checks (several problems in one message), the served
# sizes, and the ControlNet checks.
BAD_REQUESTS = [
    (dict(negative_prompt="x" * 20_000), "NEGATIVE_PROMPT has 20000 bytes"),
    (dict(steps=0, height=60), "STEPS must be between 1 and 1000, got 0; size 64x60 is not a positive multiple"),
    (dict(height=96, width=96), "size 96x96 is not served; supported sizes: 64x64"),
    (dict(controlnet="depth", control_image=np.zeros((SIZE, SIZE, 3), np.uint8)), "no ControlNet named 'depth'"),
    # image workflows (issue 25) to a txt2img-only model: refused by name, through the ensemble's encode too
    (dict(init_image=np.zeros((SIZE, SIZE, 3), np.uint8), mask=np.zeros((SIZE, SIZE), np.uint8)),
     r"WORKFLOW inpaint \(a MASK asks for inpaint\) is not served: it is not in this model's workflows \(served: "
     r"txt2img\)"),
    (dict(workflow="magic"), "unknown WORKFLOW 'magic'; choose one of txt2img, img2img, inpaint, edit"),
]


@pytest.mark.parametrize("entry", ["entry", "ensemble"])
@pytest.mark.parametrize("change,message", BAD_REQUESTS, ids=[m.split(";")[0][:30].replace("\\", "")
                                                              for _, m in BAD_REQUESTS])
def test_bad_request_is_a_clear_error(served, entry, change, message):
    model = served.report.entry if entry == "entry" else served.report.ensemble
    with pytest.raises(ServeError, match=message) as caught:
        remote(served, request(**change), model=model)
    assert type(caught.value) is ServeError  # not taken for load (RequestRejected) or a cancel


def test_server_stays_healthy_after_bad_requests(served):
    for change, _ in BAD_REQUESTS:
        with pytest.raises(ServeError):
            remote(served, request(**change))
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
    from tritonclient.utils import InferenceServerException

    tensors = request().tensors()
    del tensors["PROMPT"]
    with pytest.raises(InferenceServerException, match=r"missing required input\(s\) \['PROMPT'\]") as caught:
        raw_infer(served, tensors)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert_healthy(served)


def test_wrong_dtype_is_refused_by_name(served):
    from tritonclient.utils import InferenceServerException

    tensors = request().tensors()
    tensors["STEPS"] = tensors["STEPS"].astype(np.int64)
    with pytest.raises(InferenceServerException,
                       match="input 'STEPS' data-type is 'INT64', but model .* expects 'INT32'") as caught:
        raw_infer(served, tensors, {"STEPS": "INT64"})
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert_healthy(served)


def test_prompt_that_is_not_utf8_is_refused(served):
    from tritonclient.utils import InferenceServerException

    tensors = request().tensors()
    tensors["PROMPT"] = np.array([[b"\xff\xfe caf\xe9"]], dtype=object)
    with pytest.raises(InferenceServerException, match=f"{served.report.entry}: PROMPT is not valid UTF-8") as caught:
        raw_infer(served, tensors)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"  # the user's mistake, not an internal error
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


def test_cancelled_requests_stop_their_loops_and_free_their_instances(served):
    """Every instance busy with a 1000-step request; both cancelled: each loop stops (the UNet is called no more
    for them) and the next request is served by a freed instance: it adds exactly its own UNet calls."""
    unet_before, cancelled_before = engine_calls(served, "unet"), cancelled_in_log(served)
    long = LongRequests(served)
    long.cancel()
    long.wait()
    assert not long.results and all("cancel" in str(e).lower() for e in long.errors), long.errors
    wait_for(lambda: cancelled_in_log(served) >= cancelled_before + INSTANCES, "both instances log the cancel", served)
    stopped = engine_calls(served, "unet")
    assert stopped - unet_before < INSTANCES * LONG_STEPS  # each loop stopped at some step k < 1000
    assert remote(served, request(steps=2)).shape == (SIZE, SIZE, 3)
    # CFG batched: one UNet call per step. Had a cancelled loop kept running, it would have added its own calls;
    # had an instance still been held, this request would have waited for 1000 more.
    assert engine_calls(served, "unet") - stopped == 2


def test_requests_past_their_deadline_stop_their_loops(served):
    """Every instance busy with a 1000-step request whose gRPC deadline passes: the client hears of the
    deadline, each loop stops and the instances serve the next request."""
    unet_before, cancelled_before = engine_calls(served, "unet"), cancelled_in_log(served)
    long = LongRequests(served, timeout_s=1.0)
    long.wait()
    assert not long.results and all("deadline" in str(e).lower() for e in long.errors), long.errors
    wait_for(lambda: cancelled_in_log(served) >= cancelled_before + INSTANCES, "both instances log the cancel", served)
    stopped = engine_calls(served, "unet")
    assert stopped - unet_before < INSTANCES * LONG_STEPS
    assert remote(served, request(steps=2)).shape == (SIZE, SIZE, 3)
    assert engine_calls(served, "unet") - stopped == 2


def test_a_request_that_finds_the_queue_full_is_refused_while_the_instances_are_busy(served):
    """Both instances busy with 1000-step requests, the queue filled with QUEUE requests: one more is refused
    at once (RequestRejected while the long requests still run, so it waited for no instance); the queued
    ones are served once the long requests are cancelled; nothing hangs."""
    long = LongRequests(served)
    with ThreadPoolExecutor(QUEUE) as pool:
        queued = [pool.submit(remote, served, request(seed=i, steps=2)) for i in range(QUEUE)]
        wait_for(lambda: pending_requests(served, served.report.entry) == QUEUE, f"{QUEUE} requests queued", served)
        with pytest.raises(RequestRejected, match="(?i)exceeds maximum queue size"):
            remote(served, request(steps=2))
        assert long.finished() == 0  # refused while every instance was still busy
        long.cancel()
        long.wait()
        images = [future.result(timeout=HANG_GUARD_S) for future in queued]
    assert all(image.shape == (SIZE, SIZE, 3) for image in images)
    assert not long.results  # the long requests were cancelled, never finished: the queue stayed full
    assert_healthy(served)
