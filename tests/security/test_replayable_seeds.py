"""Every seed a server reports can be sent again (issue 44, finding 8): SEED is INT64 and the images of a request
get SEED, SEED + 1, ...; `seed=2**63-1, n=2` answered a second image with seed 2**63, which no request (and no
PNG's `--from`) can replay. The OpenAI API refuses it before Triton is called (400 naming `seed`); the entry
refuses it too (tests/triton/test_request_isolation.py), so a direct Triton client gets the same answer."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.openai_api import app as api_app
from trt_diffusion.openai_api import bodies
from trt_diffusion.openai_api.catalog import ServedModel
from trt_diffusion.openai_api.errors import ApiError
from trt_diffusion.openai_api.settings import ApiSettings

MODEL = ServedModel(name="sd15-tiny", family="sd15", sizes=("64x64",), max_images=4, workflows=("txt2img",),
                    inputs=frozenset(), created=0)


@pytest.fixture
def triton_calls(monkeypatch):
    """The Triton call replaced by one that answers n black images (and counts the calls)."""
    calls = []

    async def infer_images(client, model, tensors, timeout_s):
        calls.append(tensors)
        count = int(tensors["NUM_IMAGES"].reshape(-1)[0]) if "NUM_IMAGES" in tensors else 1
        return np.zeros((count, 64, 64, 3), np.uint8)

    async def until_done_or_gone(request, work):
        return await work

    monkeypatch.setattr(api_app, "infer_images", infer_images)
    monkeypatch.setattr(api_app, "until_done_or_gone", until_done_or_gone)
    return calls


def generate(seed: int, n: int) -> dict:
    body = bodies.parse_generation(json.dumps({"prompt": "a fox", "seed": seed, "n": n, "size": "64x64"}).encode())
    state = SimpleNamespace(triton=None)  # the app's state: _generate serves the online route and batch lines
    return asyncio.run(api_app._generate(state, ApiSettings("127.0.0.1:8001"), MODEL, body, 64, 64))


def test_seeds_that_would_pass_int64_are_refused_before_triton(triton_calls):
    with pytest.raises(ApiError) as caught:
        generate(2**63 - 1, 2)
    assert caught.value.status == 400 and caught.value.param == "seed"
    assert str(2**63 - 2) in str(caught.value)  # the largest seed n=2 may start from
    assert triton_calls == []


def test_every_reported_seed_fits_int64(triton_calls):
    answer = generate(2**63 - 4, 4)
    assert [item["seed"] for item in answer["data"]] == [2**63 - 4, 2**63 - 3, 2**63 - 2, 2**63 - 1]
    assert len(triton_calls) == 1
