"""One conformance run over every declared family (#42, acceptance 1), as tests/shared/target_conformance.py is
for targets: ONE engines.yaml holding each family's minimal entry (source = its tiny model, family, one bucket,
nothing else), built through the real build on this host's default targets (onnxruntime and openvino; TensorRT
skipped with its reason), judged by the real parity stage, packaged into ONE Triton repository served by ONE
tritonserver, one request per family with the default request fields equal to the in-process EnginePipeline's
image (frames for wan), and the OpenAI API in front of the same server for the image families. A new family is
tested here by adding its declaration: everything is parametrised over the registry.

The per-family files this run replaced are listed in the #42 note (removed test -> the case here)."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests.families.plan_keys import BUCKETS, DEFAULT_BUCKET, family_names
from trt_diffusion.families import CfgKind, family_info
from trt_diffusion.sample_inputs import cfg_fields

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

FAMILIES = family_names()
CPU_TARGETS = ("onnxruntime", "openvino")
IMAGE_FAMILIES = [f for f in FAMILIES if not family_info(f).is_video]
CASES = [pytest.param(f, t, id=f"{f}/{t}") for f in FAMILIES for t in CPU_TARGETS]
PROMPT = "a red fox running through snow"
STEPS = 2  # the request's and parity's: enough for a scheduler's second step, cheap on 2 loaded cores
SEED = 5
ANSWERED: dict[str, np.ndarray] = {}  # family -> the OpenAI API's image (test_each_model_field_routes_...)


def _bucket(family: str) -> tuple[int, int, int | None]:
    """(width, height, frames or None) of the family's one bucket."""
    sides = [int(part) for part in BUCKETS.get(family, DEFAULT_BUCKET).split("x")]
    return sides[0], sides[1], sides[2] if len(sides) == 3 else None


def image_request(family: str, **fields):
    """The family's request with its default fields: the prompt at its bucket (frames for a video bucket), its
    CFG's sample fields (Qwen-Image's empty negative prompt: true CFG); ImageRequest's defaults otherwise, but for
    STEPS and SEED."""
    from trt_diffusion.triton.client import ImageRequest

    width, height, frames = _bucket(family)
    return ImageRequest(PROMPT, height, width, **{"steps": STEPS, "seed": SEED, "frames": frames,
                                                  **cfg_fields(family), **fields})


@pytest.fixture(scope="module")
def built(built_families):
    """Every family's minimal entry built (tests/conftest.py's session build, shared with the files that judge more
    of one family's engines: tests/shared/slow_schedule.py runs them on one worker)."""
    return built_families


@pytest.fixture(scope="module")
def parity(built):
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.parity.stage import ParityOptions, run_parity

    run = run_parity(load_engines_file(built.path, check_sources=True), built.root / "parity",
                     ParityOptions(prompts=(PROMPT,), seeds=(0,), steps=STEPS, compute_lpips=False))
    return {(v.model, v.target): v for v in run.report.variants}


# Nine models in one server on a 2-core, 24 GB CI host: one entry instance and no ensemble or stream per model (about
# five python processes each instead of eleven); what is checked is each family's entry, which these leave as is
PACKAGE = dict(pipeline_instances=1, ensemble=False, stream=False)
# the nine tiny models' estimate (python processes at 0.25 GB each) is not this host's budget: the refusal is
# checked on its own below
BUDGET_GB = 64
START_GUARD_S = 900  # the server's start (nine models load and warm): a hang guard, not a latency


def _read_until(process: subprocess.Popen, marker: str) -> str:
    """The server's stdout up to the line with `marker` (it prints the OpenAI URL once everything is ready)."""
    seen = []
    deadline = time.monotonic() + START_GUARD_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"serve exited ({process.poll()}) before '{marker}':\n{''.join(seen)}")
        seen.append(line)
        if marker in line:
            return line
    pytest.fail(f"no '{marker}' within {START_GUARD_S} s:\n{''.join(seen)}")


@pytest.fixture(scope="module")
def served(built):
    """ONE repository (`package --all-models`: an entry per family) served by ONE tritonserver through `serve
    --openai-port` (the CLI users run), the OpenAI API in front of it."""
    from trt_diffusion import api
    from trt_diffusion.triton.repository import PackageOptions
    from trt_diffusion.triton.server import free_port

    repo = built.root / "repo"
    report = api.package(built.path, repo, all_models=True, options=PackageOptions(**PACKAGE),
                         memory_budget_gb=BUDGET_GB)
    http, grpc, metrics, api_port = (free_port() for _ in range(4))
    process = subprocess.Popen(
        [sys.executable, "-m", "trt_diffusion", "serve", "--repo", str(repo), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(api_port),
         "--state-dir", str(built.root / "api-state"), "--no-first-request"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
    output: list[str] = []
    try:
        line = _read_until(process, "OpenAI")
        # the rest of its output is read as it comes, so a full pipe never stalls the server
        threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
        yield SimpleNamespace(report=report, process=process, output=output, grpc_url=f"127.0.0.1:{grpc}",
                              http_url=f"127.0.0.1:{http}",
                              openai_url=f"http://127.0.0.1:{api_port}/v1", announced=line)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                raise


@pytest.fixture(scope="module")
def openai_client(served):
    import openai

    return openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=900)


def in_process(built, family: str, request, every: bool = False) -> np.ndarray:
    """The request's first image in process (`every`: all NUM_IMAGES of them)."""
    from trt_diffusion import api

    images, model = api.generate_in_process(built.path, request, model=family)
    assert model == family
    return images if every else images[0]


@pytest.mark.parametrize("family, target", CASES)
def test_builds(built, family, target):
    """Every engine the minimal entry plans on the target builds: exactly the family's default components, the
    denoiser at the batch its guidance calls it with and no other (true CFG, split CFG and embedded guidance one
    row a call: Qwen-Image, Klein, FLUX.1, FLUX.2 dev; batched CFG the two rows in one call)."""
    info = family_info(family)
    planned = {s.name for s in built.specs if (s.model, s.target) == (family, target)}
    outcomes = [o for o in built.report.outcomes if (o.spec.model, o.spec.target) == (family, target)]
    done = {o.spec.name for o in outcomes if o.failure is None}
    assert done == planned, {o.spec.name: str(o.error) for o in outcomes if o.failure is not None}
    assert {o.spec.component for o in outcomes} == set(info.default_components)
    batches = {o.spec.batch for o in outcomes if o.spec.component == info.denoiser}
    rows = {2} if info.cfg_kind is CfgKind.batched and "batched" in info.default_cfg else {1}
    assert batches == rows, (batches, info.cfg_kind, info.default_cfg)


def test_tensorrt_is_skipped_with_its_reason_where_this_host_cannot_build_it(built):
    from trt_diffusion.target_registry import get_target

    if get_target("tensorrt").unavailable_reason() is None:
        pytest.skip("this host builds TensorRT: its cases are the GPU suite's")
    assert "tensorrt" in built.report.skipped_targets, built.report.skipped_targets
    assert not any(o.spec.target == "tensorrt" for o in built.report.outcomes)


@pytest.mark.parametrize("family, target", CASES)
def test_parity(built, parity, family, target):
    """The real parity stage's gates on the family's default precisions, per target (a video per frame)."""
    variant = parity.get((family, target))
    assert variant is not None, f"no parity variant for {family} on {target}: {sorted(parity)}"
    assert variant.passed, variant.failure_reasons
    frames = _bucket(family)[2]
    if frames is not None:
        (image,) = variant.images
        assert image.video is not None and len(image.video.psnr_db) == frames


def test_package_refuses_models_over_the_memory_budget_naming_each_share(built, tmp_path):
    """The nine entries' estimate against a budget they do not fit: one error naming each model's share, nothing
    written; a model that is not in engines.yaml, and several models with neither --model nor --all-models, are
    refused by name."""
    from trt_diffusion import api
    from trt_diffusion.errors import ServeError

    with pytest.raises(ServeError) as caught:
        api.package(built.path, tmp_path / "repo", all_models=True, memory_budget_gb=0.5)
    message = str(caught.value)
    assert "above the 0.5 GB memory budget (--memory-budget-gb)" in message and "python processes" in message
    shares = [part.split(" ")[0] for part in message.split("(--memory-budget-gb): ", 1)[1].split("; ")]
    assert shares == FAMILIES, message
    assert not (tmp_path / "repo").exists()  # nothing half-written
    with pytest.raises(ServeError, match=f"has no model 'nope'; its models: {', '.join(FAMILIES)}$"):
        api.package(built.path, tmp_path / "repo", model=["sd15", "nope"])
    with pytest.raises(ServeError, match=rf"has {len(FAMILIES)} models \({', '.join(FAMILIES)}\); choose with "
                                         r"--model \(repeatable\) or --all-models"):
        api.package(built.path, tmp_path / "repo")


def test_one_server_holds_every_family(served, openai_client):
    pipelines = served.report.all_pipelines()
    assert [p.entry for p in pipelines] == [p.family for p in pipelines] == FAMILIES
    assert [m["model"] for m in served.report.memory] == FAMILIES
    assert served.openai_url in served.announced
    # the Images API lists the image entries (a video entry answers /v1/videos)
    assert sorted(m.id for m in openai_client.models.list().data) == sorted(IMAGE_FAMILIES)


@pytest.mark.triton
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_answers_the_in_process_image(served, built, family):
    from trt_diffusion.triton.client import generate_images

    request = image_request(family)
    images, _ = generate_images(served.grpc_url, request, pipeline=family, protocol="grpc", timeout_s=900)
    expected = in_process(built, family, request)
    width, height, frames = _bucket(family)
    assert images.shape == (1, *((frames,) if frames else ()), height, width, 3), images.shape
    np.testing.assert_array_equal(images[0], expected)


def _off_default(declared) -> float:
    """A value of a declared request input that is not its default and within its range."""
    value = declared.default * 0.5 if declared.default else 0.9
    if declared.data_type is int:
        value = int(declared.default) + 1
    low = declared.minimum if declared.minimum is not None else value
    high = declared.maximum if declared.maximum is not None else value
    return declared.data_type(min(max(value, low), high))


@pytest.mark.triton
@pytest.mark.parametrize("family", [f for f in FAMILIES if family_info(f).request_inputs])
def test_declared_request_inputs_reach_the_entry(served, built, family):
    """The inputs the family declares (Z-Image's CFG_NORMALIZATION, CFG_TRUNCATION), each off its default, over
    HTTP with NUM_IMAGES 2 (seeds SEED, SEED + 1): the entry's images equal the in-process pipeline's with the same
    inputs, and differ from the defaults' (an input the entry dropped could not pass)."""
    from trt_diffusion.triton.client import generate_images

    inputs = {d.argument: _off_default(d) for d in family_info(family).request_inputs}
    request = image_request(family, num_images=2, inputs=inputs, steps=3)  # a third step: truncation acts
    images, _ = generate_images(served.http_url, request, pipeline=family, protocol="http", timeout_s=900)
    expected = in_process(built, family, request, every=True)
    np.testing.assert_array_equal(images, expected)
    assert not np.array_equal(images[0], in_process(built, family, image_request(family, steps=3)))


@pytest.mark.triton
@pytest.mark.parametrize("family", FAMILIES)
def test_an_input_of_another_family_is_one_clear_error_and_the_entry_answers_the_next(served, family):
    """A request input another family declares (Z-Image's CFG_TRUNCATION) sent to this family's entry is refused
    naming it, and the entry's next request runs."""
    from trt_diffusion.errors import ServeError
    from trt_diffusion.families import request_inputs_of_all
    from trt_diffusion.triton.client import generate_images

    own = {d.argument for d in family_info(family).request_inputs}
    foreign = [d for d in request_inputs_of_all().values() if d.argument not in own]
    if not foreign:
        pytest.skip(f"{family} declares every family's request inputs")
    declared = foreign[0]
    with pytest.raises(ServeError, match=declared.name):
        generate_images(served.grpc_url, image_request(family, inputs={declared.argument: declared.default}),
                        pipeline=family, protocol="grpc", timeout_s=900)
    images, _ = generate_images(served.grpc_url, image_request(family, steps=1), pipeline=family, protocol="grpc",
                                timeout_s=900)
    assert len(images) == 1


@pytest.mark.triton
@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_openai_api_answers_the_in_process_image(openai_client, built, family):
    """/v1/images/generations through the official client in front of the same server, the `model` field routing
    to the family's entry (wan joins when the API serves /v1/videos from this run). The API's defaults (guidance
    7.5, no negative prompt unless sent) are the in-process request's; Qwen-Image's default fields carry its empty
    negative prompt."""
    from PIL import Image

    width, height, _ = _bucket(family)
    extra = {"seed": SEED, "num_inference_steps": STEPS, **cfg_fields(family)}
    result = openai_client.images.generate(model=family, prompt=PROMPT, size=f"{width}x{height}", extra_body=extra)
    with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as image:
        got = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(got, in_process(built, family, image_request(family, guidance_scale=7.5)))
    ANSWERED[family] = got


@pytest.mark.triton
def test_each_model_field_routes_to_its_own_entry(openai_client):
    """Nine models, nine images: each equals its own family's in-process image above, and no two are the same, so
    a request routed to another entry could not pass."""
    if set(ANSWERED) != set(IMAGE_FAMILIES):
        pytest.skip("runs after every family's OpenAI request above")
    for i, a in enumerate(IMAGE_FAMILIES):
        for b in IMAGE_FAMILIES[i + 1:]:
            assert not np.array_equal(ANSWERED[a], ANSWERED[b]), (a, b)


@pytest.mark.triton
def test_the_openai_api_refuses_a_request_without_a_served_model(openai_client):
    import openai

    listed = ", ".join(sorted(IMAGE_FAMILIES))
    with pytest.raises(openai.BadRequestError, match=re.escape(
            f"model is required: this server serves {len(IMAGE_FAMILIES)} models ({listed})")):
        openai_client.images.generate(prompt=PROMPT)
    with pytest.raises(openai.NotFoundError, match=re.escape(f"model 'nope' is not served; served: {listed}")):
        openai_client.images.generate(model="nope", prompt=PROMPT)


@pytest.mark.triton
def test_serve_stops_on_sigint_with_exit_0(served):
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(timeout=120) == 0, "".join(served.output)
