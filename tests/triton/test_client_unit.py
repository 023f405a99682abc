"""The client without a server: request tensors and errors. Fast; runs in the default suite."""

from __future__ import annotations

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import client, contract
from trt_diffusion.triton.server import free_port


def test_request_tensors_follow_the_contract():
    control = np.zeros((64, 64, 3), np.uint8)
    tensors = client.ImageRequest("a cat", 64, 64, steps=3, seed=2**40, negative_prompt="dog", scheduler="ddim",
                                  controlnet="canny", control_image=control, controlnet_scale=0.5,
                                  workflow="inpaint", init_image=control, mask=np.zeros((64, 64), np.uint8),
                                  strength=0.6, frames=9, guidance_scale_2=3.0,
                                  max_sequence_length=64, loras='[{"name": "style", "scale": 0.8}]',
                                  step_cache="off").tensors()
    declared = {t.name: t for t in contract.request_inputs(True)}
    assert set(tensors) == set(declared)
    for name, value in tensors.items():
        assert value.shape == (1, *[d if d > 0 else s for d, s in zip(declared[name].dims, value.shape[1:])])
        assert client._TYPES[name] == contract.TRITON_TO_WIRE[declared[name].data_type]
    assert tensors["SEED"].dtype == np.int64 and tensors["SEED"][0, 0] == 2**40
    assert tensors["PROMPT"][0, 0] == b"a cat"
    assert tensors["INIT_IMAGE"].shape == (1, 64, 64, 3) and tensors["MASK"].shape == (1, 64, 64)
    assert tensors["WORKFLOW"][0, 0] == b"inpaint" and tensors["STRENGTH"].dtype == np.float32
    assert tensors["LORAS"][0, 0] == b'[{"name": "style", "scale": 0.8}]'
    assert tensors["FRAMES"][0, 0] == 9 and tensors["GUIDANCE_SCALE_2"].dtype == np.float32
    assert tensors["STEP_CACHE"][0, 0] == b"off"
    optional = {"NEGATIVE_PROMPT", "SCHEDULER", "CONTROLNET", "CONTROL_IMAGE", "CONTROLNET_SCALE", "WORKFLOW",
                "INIT_IMAGE", "MASK", "STRENGTH", "FRAMES", "GUIDANCE_SCALE_2", "MAX_SEQUENCE_LENGTH", "LORAS",
                "STEP_CACHE"}
    assert set(client.ImageRequest("a cat", 64, 64).tensors()) == set(declared) - optional


def test_urls_may_carry_a_scheme():
    assert client.strip_scheme("http://127.0.0.1:8000/") == "127.0.0.1:8000"
    assert client.strip_scheme("127.0.0.1:8001") == "127.0.0.1:8001"
    with pytest.raises(ServeError, match="protocol must be one of"):
        client.client_module("websocket")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_no_server_is_a_clear_error(protocol):
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ServeError, match=f"cannot reach Triton at {url}.*trt-diffusion serve"):
        client.generate(url, protocol=protocol, pipeline="p", prompt="a cat", height=64, width=64, timeout_s=5)


def test_a_controlnet_request_to_a_pipeline_without_one_says_so():
    """Triton's own words for an input the model lacks become the project's (#31)."""
    raw = Exception("[request id: <id_unknown>] unexpected inference input 'CONTROLNET' for model 'sd15-tiny'")
    error = client.server_error(raw, "127.0.0.1:8000", "sd15-tiny")
    assert "serves no ControlNet" in str(error) and "leave out --controlnet" in str(error)
    assert "unexpected inference input" not in str(error)
