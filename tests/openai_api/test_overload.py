"""The overload policy (engines.yaml `serving: overload:`) on a controlled cost model, never a clock: below
degrade_after_s a request runs as asked, past it with the policy's fewer steps or smaller bucket (header, PNG
parameters, counter), past refuse_after_s it is refused 429 with Retry-After from the queue; batch lines are never
degraded; the engines.yaml block is checked where it is written."""

from __future__ import annotations

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from images_stub_triton import expected_image, start_images_stub
from pydantic import ValidationError

from trt_diffusion.engines_file.schema import OverloadSettings, ServingSettings
from trt_diffusion.openai_api.overload import OverloadGate, OverloadPolicy, Refused, StepCosts

GUARD_S = 60
POLICY = OverloadPolicy(degrade_after_s=10, refuse_after_s=22, degrade_steps=4)


def costs() -> StepCosts:
    return StepCosts(known={("sd15-tiny", "64x64"): 1.0, ("sd15-tiny", "32x48"): 0.25})  # seconds a step


def test_degrade_then_refuse_at_the_thresholds():
    gate = OverloadGate({"sd15-tiny": POLICY}, costs())
    first = gate.admit("sd15-tiny", "64x64", 20, 1)  # nothing ahead
    assert (first.steps, first.degraded, first.cost_s) == (20, None, 20.0)
    second = gate.admit("sd15-tiny", "64x64", 20, 1)  # 20 s ahead: past 10
    assert (second.steps, second.degraded, second.cost_s) == (4, "steps 20->4", 4.0)
    with pytest.raises(Refused) as refused:  # 24 s ahead: past 22
        gate.admit("sd15-tiny", "64x64", 20, 1)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "2"}  # 24 - 22
    assert "estimated wait is 24 s, past its 22 s limit" in refused.value.message
    gate.release(first, finished=True)
    assert gate.estimated_wait_s("sd15-tiny") == 4.0
    assert gate.admit("sd15-tiny", "64x64", 3, 1).degraded is None  # under 10 again; 3 steps is below 4 anyway
    assert gate.state() == {"sd15-tiny:degraded": 1, "sd15-tiny:refused": 1}
    assert gate.admit("sdxl-tiny", "64x64", 50, 4).degraded is None  # no policy: off


def test_the_wait_is_shared_by_the_instances_and_a_bucket_can_be_the_degradation():
    policy = OverloadPolicy(degrade_after_s=10, degrade_size="32x48")
    gate = OverloadGate({"sd15-tiny": policy}, costs(), instances=lambda model: 2)
    gate.admit("sd15-tiny", "64x64", 20, 1)
    assert gate.estimated_wait_s("sd15-tiny") == 10.0  # 20 s of work over two instances
    served = ("64x64", "32x48")
    lowered = gate.admit("sd15-tiny", "64x64", 20, 1, served)
    assert (lowered.size, lowered.degraded, lowered.cost_s) == ("32x48", "size 64x64->32x48", 5.0)
    assert gate.admit("sd15-tiny", "64x64", 20, 1, served, resizable=False).degraded is None  # an edit's image
    assert gate.admit("sd15-tiny", "64x64", 20, 1, ("64x64",)).degraded is None  # the bucket is not served


def test_live_costs_learn_only_from_requests_that_ran_alone():
    now = [0.0]
    learned = StepCosts()
    gate = OverloadGate({"m": POLICY}, learned, clock=lambda: now[0])
    alone = gate.admit("m", "64x64", 10, 1)
    queued = gate.admit("m", "64x64", 10, 1)
    now[0] = 5.0
    gate.release(alone, finished=True)
    now[0] = 10.0
    gate.release(queued, finished=True)  # its 10 s include the wait behind the first: 1.0 a step, not learned
    assert learned.known == {("m", "64x64"): 0.5}


def test_a_bucket_never_measured_costs_what_the_model_measured_per_pixel():
    learned = StepCosts(known={("m", "64x64"): 1.0})
    assert learned.seconds("m", "32x32", 10, 1) == 2.5  # a quarter of the pixels
    assert learned.seconds("m", "128x64", 10, 2) == 40.0
    gate = OverloadGate({"m": POLICY}, learned)
    gate.admit("m", "32x32", 20, 1)
    assert gate.estimated_wait_s("m") == 5.0  # not 0: the gate acts before this bucket's first measurement


@pytest.mark.parametrize("block, message", [
    ({"refuse_after_s": 5, "degrade_after_s": 10, "degrade": {"steps": 4}}, "must be above degrade_after_s"),
    ({"degrade_after_s": 10}, "degrade_after_s and degrade go together"),
    ({"degrade_after_s": 10, "degrade": {"steps": 4, "size": "512x512"}}, "give one of steps"),
    ({"degrade_after_s": 10, "degrade": {"size": "big"}}, "big"),
    ({}, "leave overload out to keep it off"),
    ({"refuse_after_s": -1}, "greater than 0"),
])
def test_the_engines_yaml_block_is_checked(block, message):
    with pytest.raises(ValidationError, match=message):
        ServingSettings.model_validate({"overload": block})


def test_a_policy_comes_from_the_engines_yaml_block():
    settings = OverloadSettings.model_validate({"degrade_after_s": 10, "refuse_after_s": 22,
                                                "degrade": {"steps": 4}})
    assert OverloadPolicy.from_settings(settings) == POLICY
    assert ServingSettings().overload is None  # off by default


@pytest.fixture
def held_api(request, tmp_path):
    from trt_diffusion.openai_api.server import ApiServer
    from trt_diffusion.openai_api.settings import ApiSettings

    stub = start_images_stub()
    stub.instances = getattr(request, "param", 1)  # the wait is the queue's work over the model's instances
    stub.gate = threading.Semaphore(0)
    settings = ApiSettings(stub.url, port=0, overload=(("sd15-tiny", POLICY),), cost_model=costs(),
                           state_dir=tmp_path / "state")
    try:
        with ApiServer(settings) as server:
            yield stub, server
    finally:
        stub.stop()


def test_the_api_degrades_then_refuses_and_says_so(held_api):
    import openai
    from PIL import Image

    stub, api = held_api
    client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_generate, client, 1)
        until(lambda: stub.arrivals == 1)
        second = pool.submit(_generate, client, 2)  # 20 s of work ahead: degraded to 4 steps
        until(lambda: stub.arrivals == 2)
        with pytest.raises(openai.RateLimitError, match="past its 22 s limit") as refused:
            _generate(client, 3)  # 24 s ahead
        assert refused.value.response.headers["retry-after"] == "2"
        stub.gate.release(2)
        first, second = first.result(GUARD_S), second.result(GUARD_S)
    assert "x-trt-diffusion-degraded" not in first.headers
    assert second.headers["x-trt-diffusion-degraded"] == "steps 20->4"
    item = second.parse().data[0]
    with Image.open(io.BytesIO(base64.b64decode(item.b64_json))) as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), expected_image("sd15-tiny", "a", 2, 64, 64, 4))
        assert "Steps: 4" in image.info["parameters"]  # the PNG says what ran
    stub.gate.release(10)
    assert "x-trt-diffusion-degraded" not in _generate(client, 4).headers  # the queue drained: as asked again
    import json
    import urllib.request

    with urllib.request.urlopen(api.url.removesuffix("/v1") + "/health", timeout=10) as response:
        assert json.loads(response.read())["overload"] == {"sd15-tiny:degraded": 1, "sd15-tiny:refused": 1}


@pytest.mark.parametrize("held_api", [2], indirect=True)
def test_the_api_spreads_the_wait_over_the_models_instances(held_api):
    import openai

    stub, api = held_api
    client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)

    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(_generate, client, 1)]
        until(lambda: stub.arrivals == 1)
        held.append(pool.submit(_generate, client, 2))  # 20 s over 2 instances: 10 s, degraded to 4 steps
        until(lambda: stub.arrivals == 2)
        third = pool.submit(_generate, client, 3)  # 24 s over 2: 12 s, under the 22 s limit (one instance: refused)
        until(lambda: stub.arrivals == 3 or third.done())  # done early: refused
        stub.gate.release(3)
        responses = [future.result(GUARD_S) for future in (*held, third)]
    assert [r.headers.get("x-trt-diffusion-degraded") for r in responses] == [None, "steps 20->4", "steps 20->4"]


def test_batch_lines_are_never_degraded(held_api):
    import json

    import openai

    stub, api = held_api
    client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)
    with ThreadPoolExecutor(1) as pool:
        online = pool.submit(client.images.generate, model="sd15-tiny", prompt="a", extra_body={"seed": 1})
        until(lambda: stub.arrivals == 1)  # 20 s of online work ahead of the batch line
        line = {"custom_id": "x", "method": "POST", "url": "/v1/images/generations",
                "body": {"model": "sd15-tiny", "prompt": "b", "seed": 5, "num_inference_steps": 20}}
        upload = client.files.create(file=("a.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/images/generations",
                                      completion_window="24h")
        stub.gate.release(10)
        online.result(GUARD_S)
    until(lambda: client.batches.retrieve(batch.id).status == "completed")
    (record,) = [json.loads(x) for x in client.files.content(
        client.batches.retrieve(batch.id).output_file_id).text.splitlines()]
    body = record["response"]["body"]
    assert "degraded" not in body
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert np.array_equal(pixels, expected_image("sd15-tiny", "b", 5, 64, 64, 20))  # all 20 steps


def _generate(client, seed: int):
    """A 20-step request: 20 s of work by the tests' cost model."""
    return client.images.with_raw_response.generate(model="sd15-tiny", prompt="a", extra_body={
        "seed": seed, "num_inference_steps": 20})


def until(check, guard_s: float = GUARD_S):
    import time

    end = time.monotonic() + guard_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("the condition did not come true in time")


def _engines_yaml(tmp_path, overload: dict):
    """engines.yaml serving the stub's sd15-tiny entry with `overload`; its source need not exist where the API
    runs (the API serves what Triton loaded)."""
    import yaml

    model = {"source": "models/elsewhere", "family": "sd15", "buckets": ["64x64", "32x48"],
             "serving": {"overload": overload}}
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": {"sd15-tiny": model}}, sort_keys=False))
    return path


def test_openai_api_serves_the_policy_of_its_config(tmp_path, monkeypatch, capsys):
    """`openai-api --config engines.yaml`, through the CLI's own entry: the file's policy is what the API serves
    with. Only the foreground run is replaced (it would serve until Ctrl-C): the settings the command built are
    served here, with the controlled cost model in place of the live one."""
    import dataclasses

    import openai

    from trt_diffusion.cli import main
    from trt_diffusion.openai_api import server

    served = []
    monkeypatch.setattr(server, "run", served.append)
    config = _engines_yaml(tmp_path, {"degrade_after_s": 10, "refuse_after_s": 22, "degrade": {"steps": 4}})
    stub = start_images_stub()
    try:
        code = main(["openai-api", "--config", str(config), "--triton-url", stub.url,
                     "--state-dir", str(tmp_path / "state")])
        output = " ".join(capsys.readouterr().out.split())
        assert code == 0 and len(served) == 1, output
        assert served[0].overload == (("sd15-tiny", POLICY),)
        assert "overload policy sd15-tiny: degraded to 4 steps past 10 s of estimated wait, refused past 22 s" in output
        stub.gate = threading.Semaphore(0)
        with server.ApiServer(dataclasses.replace(served[0], port=0, cost_model=costs())) as api:
            client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0)

            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(_generate, client, 1)
                until(lambda: stub.arrivals == 1)
                second = pool.submit(_generate, client, 2)  # 20 s of work ahead over the stub's 2 instances: 10 s
                until(lambda: stub.arrivals == 2)
                stub.gate.release(2)
                assert "x-trt-diffusion-degraded" not in first.result(GUARD_S).headers
                assert second.result(GUARD_S).headers["x-trt-diffusion-degraded"] == "steps 20->4"
    finally:
        stub.stop()


@pytest.mark.parametrize("overload, message", [
    ({"refuse_after_s": -1}, "models.sd15-tiny.serving.overload.refuse_after_s"),
    ({"refuse_after": 5}, "refuse_after"),
    ({"degrade_after_s": 10, "degrade": {"size": "16x16"}},
     "models.sd15-tiny.serving.overload.degrade.size: 16x16 is not a size sd15-tiny serves (its buckets: 64x64, "
     "32x48)"),
])
def test_a_bad_policy_is_refused_by_name_before_the_api_starts(overload, message, tmp_path, monkeypatch, capsys):
    from trt_diffusion.cli import main
    from trt_diffusion.openai_api import server

    served = []
    monkeypatch.setattr(server, "run", served.append)
    code = main(["openai-api", "--config", str(_engines_yaml(tmp_path, overload)),
                 "--state-dir", str(tmp_path / "state")])
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert code == 1 and message in text and "Traceback" not in text and served == [], text
    assert not (tmp_path / "state").exists()  # refused before the job store is opened


def test_serve_takes_the_config_only_with_its_api(tmp_path, capsys):
    from trt_diffusion.cli import main

    code = main(["serve", "--repo", str(tmp_path), "--config", str(_engines_yaml(tmp_path, {"refuse_after_s": 5}))])
    text = " ".join(capsys.readouterr().err.split())
    assert code == 1 and "--config gives the OpenAI API its overload policies: give --openai-port too" in text, text
