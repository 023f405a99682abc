"""Request values are bounded before any work: prompt bytes before decoding (issue 20, item 4), a finite
CONTROLNET_SCALE (item 11). No server: the request reader and the pipeline's checks, directly."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.triton.backend import pb, requests


def _tensors(**change) -> dict:
    values = {"PROMPT": "a lighthouse", "HEIGHT": 64, "WIDTH": 64, "STEPS": 3, "GUIDANCE_SCALE": 7.5, "SEED": 0}
    values.update(change)

    def array(value):
        if isinstance(value, (str, bytes)):
            return np.array([[value.encode() if isinstance(value, str) else value]], dtype=object)
        return np.array([[value]], dtype=np.float32 if isinstance(value, float) else np.int32)

    return {name: array(value) for name, value in values.items() if value is not None}


@pytest.fixture
def read(monkeypatch):
    monkeypatch.setattr(pb, "input_array", lambda request, name: request.get(name))
    return requests.read_request


@pytest.mark.parametrize("name", ["PROMPT", "NEGATIVE_PROMPT"])
def test_a_huge_prompt_is_refused_by_its_bytes_before_decoding(read, name):
    # Not UTF-8 at all: had it been decoded first, the refusal would say so. The byte count came first.
    huge = b"\xff" * 50_000_000
    with pytest.raises(RuntimeInputError, match=f"{name} has 50000000 bytes \\(at most 16384\\)"):
        read(_tensors(**{name: huge}))


def test_a_negative_prompt_within_the_cap_is_read(read):
    request = read(_tensors(NEGATIVE_PROMPT="blurry, " * 100))
    assert request.negative_prompt.startswith("blurry")


def test_scheduler_and_controlnet_names_are_short(read):
    with pytest.raises(RuntimeInputError, match="SCHEDULER has 10000 bytes"):
        read(_tensors(SCHEDULER="x" * 10_000))
    with pytest.raises(RuntimeInputError, match="CONTROLNET has 10000 bytes"):
        read(_tensors(CONTROLNET="x" * 10_000))


@pytest.fixture(scope="module")
def pipeline(tiny_sd15_dir):
    table = RunnerTable()
    table.add("controlnet", None, controlnet="canny")
    return EnginePipeline(tiny_sd15_dir, "sd15", table)


def _request(**change) -> GenerationRequest:
    values = dict(prompt="a lighthouse", height=64, width=64, steps=3)
    values.update(change)
    return GenerationRequest(**values)


def test_a_long_negative_prompt_is_refused_by_the_pipeline(pipeline):
    with pytest.raises(RuntimeInputError, match="NEGATIVE_PROMPT has 5000 characters \\(at most 4096\\)"):
        pipeline.validate(_request(negative_prompt="x" * 5000))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), -1.0, 1000.0])
def test_controlnet_scale_must_be_finite_and_in_range(pipeline, scale):
    image = np.zeros((64, 64, 3), np.uint8)
    with pytest.raises(RuntimeInputError, match="CONTROLNET_SCALE must be in \\[0, 100.0\\]"):
        pipeline.validate(_request(controlnet="canny", control_image=image, controlnet_scale=scale))


def test_controlnet_scale_from_a_request_is_checked(read, pipeline):
    image = np.zeros((1, 64, 64, 3), np.uint8)
    request = read({**_tensors(CONTROLNET="canny", CONTROLNET_SCALE=float("nan")), "CONTROL_IMAGE": image})
    with pytest.raises(RuntimeInputError, match="CONTROLNET_SCALE"):
        pipeline.validate(request)
    pipeline.validate(read({**_tensors(CONTROLNET="canny", CONTROLNET_SCALE=0.5), "CONTROL_IMAGE": image}))
