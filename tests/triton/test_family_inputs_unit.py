"""A family's own request inputs over Triton (issue #42), without a server: the entry of a family that declares
them (Z-Image: CFG_NORMALIZATION, CFG_TRUNCATION) lists them as optional FP32 inputs and no other entry does; the
client sends them from `ImageRequest.inputs`; the backend's reader turns them back into the request's `inputs`,
refusing a bad value by the input's name; the runtime refuses them for a family that does not declare them."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion.errors import RuntimeInputError, ServeError
from trt_diffusion.families import FAMILIES, Family, family_info
from trt_diffusion.runtime.requests import GenerationRequest, input_problems, input_value
from trt_diffusion.triton import contract
from trt_diffusion.triton.backend import pb, requests
from trt_diffusion.triton.client import ImageRequest

NEW = ("CFG_NORMALIZATION", "CFG_TRUNCATION")


@pytest.fixture
def read(monkeypatch):
    """`read(ImageRequest) -> GenerationRequest` through the backend's reader, tensors as Triton hands them."""
    monkeypatch.setattr(pb, "input_array", lambda tensors, name: tensors.get(name))
    return lambda image_request: requests.read_request(image_request.tensors())


def request(**change) -> ImageRequest:
    return ImageRequest(**{"prompt": "a red circle", "height": 64, "width": 64, "steps": 3, "guidance_scale": 5.0,
                           **change})


@pytest.mark.parametrize("stage", ["full", "stream"])
def test_only_the_declaring_familys_entry_takes_them(stage):
    for family in FAMILIES:
        inputs = {t.name: t for t in contract.stage_io(stage, family, False)[0]}
        declared = {d.name for d in family_info(family).request_inputs}
        assert declared == {n for n in inputs if n in NEW}, family
        for name in declared:
            assert inputs[name].data_type == "TYPE_FP32" and inputs[name].optional
    assert {d.name for d in family_info(Family.z_image).request_inputs} == set(NEW)


def test_sent_and_read_back(read):
    tensors = request(inputs={"cfg_truncation": 0.3, "cfg_normalization": 1}).tensors()
    assert tensors["CFG_TRUNCATION"].dtype == np.float32 and tensors["CFG_TRUNCATION"].shape == (1, 1)
    parsed = read(request(inputs={"cfg_truncation": 0.3, "cfg_normalization": 1}))
    assert parsed.inputs == {"cfg_truncation": 0.3, "cfg_normalization": 1.0}  # 0.3, not float32's 0.30000001
    assert read(request()).inputs == {}
    assert "CFG_TRUNCATION" not in request().tensors()


@pytest.mark.parametrize(("inputs", "words"), [
    ({"cfg_truncation": -1.0}, r"CFG_TRUNCATION must be in \[0, 100\], got -1.0"),
    ({"cfg_normalization": float("nan")}, "CFG_NORMALIZATION must be finite"),
    ({"cfg_normalization": 1e6}, r"CFG_NORMALIZATION must be in \[0, 100\]"),
])
def test_a_bad_value_is_refused_naming_the_input(read, inputs, words):
    with pytest.raises(RuntimeInputError, match=words):
        read(request(inputs=inputs))


def test_the_client_refuses_an_input_no_family_declares():
    with pytest.raises(ServeError, match="'cfg_rescale' is not a request input of any family"):
        request(inputs={"cfg_rescale": 0.7}).tensors()


def test_defaults_and_the_runtime_check():
    z_image = family_info(Family.z_image).request_inputs
    by_argument = {d.argument: d for d in z_image}
    plain = GenerationRequest(prompt="p", height=64, width=64)
    assert input_value(plain, by_argument["cfg_truncation"]) == 1.0
    assert input_value(plain, by_argument["cfg_normalization"]) == 0.0
    asked = GenerationRequest(prompt="p", height=64, width=64, inputs={"cfg_truncation": 0.5})
    assert input_problems(z_image, asked) == []
    others = [f for f, info in FAMILIES.items() if not info.request_inputs]
    assert others
    for family in others:
        (problem,) = input_problems(family_info(family).request_inputs, asked)
        assert problem.startswith("CFG_TRUNCATION is not an input of this model")


def test_generate_input_option():
    """`generate --input NAME=VALUE` (repeatable) fills ImageRequest.inputs; a name no family declares, or a value that
    is not a number, fails before any request."""
    from trt_diffusion.cli.serve_commands import _family_inputs
    from trt_diffusion.errors import ConfigError

    assert _family_inputs(["cfg_truncation=0.5", "CFG_NORMALIZATION = 1"]) == {"cfg_truncation": 0.5,
                                                                               "cfg_normalization": 1.0}
    assert _family_inputs(None) is None
    with pytest.raises(ConfigError, match="NAME one of cfg_normalization, cfg_truncation"):
        _family_inputs(["cfg_rescale=0.7"])
    with pytest.raises(ConfigError, match="CFG_TRUNCATION must be a number"):
        _family_inputs(["cfg_truncation=half"])
