"""Every refusal a pipeline model makes, without a server: the request tensors a client sends (ImageRequest
.tensors()), read by the backend's request reader, checked by the pipeline over the engines the plan serves
(the same routing table the served model builds, with no engine behind it: validation runs none). A few of
these go through a real server in test_serving.py."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline
from trt_diffusion.triton.backend import pb, requests
from trt_diffusion.triton.client import ImageRequest

SIZE = 64
PROMPT = "a lighthouse on a cliff at dusk"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_model_factory, write_engines_yaml) -> EnginePipeline:
    """The sd15 tiny plan test_serving serves (64x64, CFG batched, ControlNet `canny`), as a routing table."""
    model_dir = tiny_model_factory("sd15", controlnet=True)
    config = write_engines_yaml(tmp_path_factory.mktemp("request-parsing"), model_dir, "sd15", name="sd15-tiny",
                                controlnets={"canny": {"source": str(model_dir / "controlnet")}})
    table = RunnerTable()
    for spec in expand(load_engines_file(config)):
        table.add(spec.component, None, bucket=spec.bucket, batch=spec.batch, controlnet=spec.controlnet)
    return EnginePipeline(model_dir, "sd15", table)


@pytest.fixture
def read(monkeypatch):
    """`read(ImageRequest) -> GenerationRequest` through the backend's reader, tensors as Triton hands them."""
    monkeypatch.setattr(pb, "input_array", lambda tensors, name: tensors.get(name))
    return lambda image_request, **kwargs: requests.read_request(image_request.tensors(), **kwargs)


def request(**change) -> ImageRequest:
    values = dict(prompt=PROMPT, height=SIZE, width=SIZE, steps=3, guidance_scale=7.5, seed=0)
    values.update(change)
    return ImageRequest(**values)


CONTROL = np.zeros((SIZE, SIZE, 3), np.uint8)
BAD_REQUESTS = [
    (dict(height=96, width=96), "size 96x96 is not served; supported sizes: 64x64"),
    (dict(height=60), "not a positive multiple of 8"),
    (dict(steps=0), "STEPS must be between 1 and 1000, got 0"),
    (dict(steps=10_000), "STEPS must be between 1 and 1000, got 10000"),
    (dict(prompt=""), "PROMPT is empty"),
    (dict(prompt="x" * 10_000), "PROMPT has 10000 characters"),
    (dict(negative_prompt="x" * 20_000), "NEGATIVE_PROMPT has 20000 bytes"),
    (dict(controlnet="canny", control_image=CONTROL, controlnet_scale=float("nan")), "CONTROLNET_SCALE must be in"),
    (dict(scheduler="magic"), "unknown scheduler 'magic'"),
    (dict(guidance_scale=float("nan")), "GUIDANCE_SCALE must be in"),
    (dict(controlnet="depth", control_image=CONTROL), "no ControlNet named 'depth'"),
    (dict(controlnet="canny"), "a ControlNet request needs CONTROL_IMAGE"),
    (dict(controlnet="canny", control_image=np.zeros((32, SIZE, 3), np.uint8)), r"CONTROL_IMAGE is \[32, 64, 3\]"),
    (dict(steps=0, height=60), "STEPS must be between 1 and 1000, got 0; size 64x60 is not a positive multiple"),
]


@pytest.mark.parametrize("change,message", BAD_REQUESTS, ids=[m.split(";")[0][:30].replace("\\", "")
                                                              for _, m in BAD_REQUESTS])
def test_bad_request_is_a_clear_error(pipeline, read, change, message):
    with pytest.raises(RuntimeInputError, match=message):
        pipeline.validate(read(request(**change)))


def test_a_good_request_is_read_as_sent(pipeline, read):
    control = (np.arange(SIZE * SIZE * 3) % 251).astype(np.uint8).reshape(SIZE, SIZE, 3)
    generation = read(request(seed=2**40, negative_prompt="blurry", scheduler="euler_a", controlnet="canny",
                              control_image=control, controlnet_scale=0.5))
    assert (generation.prompt, generation.negative_prompt, generation.scheduler) == (PROMPT, "blurry", "euler_a")
    assert (generation.height, generation.width, generation.steps, generation.seed) == (SIZE, SIZE, 3, 2**40)
    assert (generation.guidance_scale, generation.controlnet, generation.controlnet_scale) == (7.5, "canny", 0.5)
    np.testing.assert_array_equal(generation.control_image, control)
    assert pipeline.validate(generation) is not None


def test_the_denoise_stage_reads_no_prompt(pipeline, read):
    generation = read(request(prompt="", negative_prompt="x" * 20_000), with_prompt=False)
    assert generation.prompt == requests.UPSTREAM_PROMPT and generation.negative_prompt is None
    pipeline.validate(generation)  # the encode stage refused a bad prompt already


def test_optional_inputs_take_their_defaults(read):
    generation = read(request())
    assert (generation.negative_prompt, generation.scheduler, generation.controlnet) == (None, "default", None)
    assert generation.controlnet_scale == 1.0 and generation.control_image is None


def test_a_value_that_is_not_one_value_is_refused(read):
    tensors = request().tensors()
    tensors["STEPS"] = np.array([[3, 4]], np.int32)
    with pytest.raises(RuntimeInputError, match=r"STEPS must hold one value, got shape \[1, 2\]"):
        requests.read_request(tensors)


def test_loras_are_read_canonical_and_keep_requests_apart(pipeline, read):
    """LORAS (issue 28): the set is read in its canonical form; requests of different sets never share a
    denoiser call (the batch key holds the set), equal sets listed in any order do."""
    served = ("detail", "style")
    one = read(request(loras='[{"name": "style", "scale": 0.8}, {"name": "detail", "scale": 1}]'), served_loras=served)
    two = read(request(loras='[{"name": "detail"}, {"name": "style", "scale": 0.8}]'), served_loras=served)
    other = read(request(loras='[{"name": "style", "scale": 0.5}]'), served_loras=served)
    base = read(request(), served_loras=served)
    assert [(c.name, c.scale) for c in one.loras] == [("detail", 1.0), ("style", 0.8)]
    assert pipeline.batch_key(one) == pipeline.batch_key(two)
    assert len({pipeline.batch_key(r) for r in (one, other, base)}) == 3
    assert base.loras == () and read(request(loras="[]"), served_loras=served).loras == ()
    with pytest.raises(RuntimeInputError, match="unknown LoRA 'anime'; this model serves: detail, style"):
        read(request(loras='[{"name": "anime"}]'), served_loras=served)
    with pytest.raises(RuntimeInputError, match="this model serves: none"):
        read(request(loras='[{"name": "style"}]'))
