"""The API's request bodies, errors and settings: what is accepted, and each refusal naming its field and value."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.openai_api import bodies, pngs
from trt_diffusion.openai_api.catalog import ServedModel, check_n, check_size
from trt_diffusion.openai_api.errors import ApiError
from trt_diffusion.openai_api.settings import ApiSettings


def generation(**fields) -> bytes:
    return json.dumps({"prompt": "a fox", **fields}).encode()


def refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        bodies.parse_generation(raw)
    assert caught.value.status == 400
    return caught.value


def test_defaults_and_extensions():
    body = bodies.parse_generation(generation())
    assert (body.n, body.size, body.seed, body.num_inference_steps, body.guidance_scale) == (1, None, None, 20, None)
    body = bodies.parse_generation(generation(n=3, size="64x64", seed=7, num_inference_steps=4, guidance_scale=1,
                                              negative_prompt="blur", response_format="b64_json", model="m"))
    assert (body.n, body.size, body.seed, body.num_inference_steps, body.guidance_scale) == (3, "64x64", 7, 4, 1.0)
    assert bodies.parse_generation(generation(size="auto")).size is None


@pytest.mark.parametrize("fields, words", [
    ({"num_inference_step": 4}, "unknown field 'num_inference_step'; this endpoint takes model, prompt"),
    ({"response_format": "url"}, "response_format 'url' is not served: images come back inline, use "
                                 "response_format b64_json"),
    ({"size": "big"}, "size must be WIDTHxHEIGHT like '512x512' (or 'auto'), got 'big'"),
    ({"n": 0}, "n: Input should be greater than or equal to 1 (got 0)"),
    ({"n": 11}, "n: Input should be less than or equal to 10 (got 11)"),
    ({"n": "2"}, "n: Input should be a valid integer (got '2')"),
    ({"seed": -1}, "seed: Input should be greater than or equal to 0 (got -1)"),
    ({"num_inference_steps": 0}, "num_inference_steps: Input should be greater than or equal to 1 (got 0)"),
    ({"guidance_scale": 101}, "guidance_scale: Input should be less than or equal to 100 (got 101)"),
    ({"prompt": ""}, "prompt: String should have at least 1 character (got '')"),
    ({"prompt": "x" * 4097}, "prompt: String should have at most 4096 characters"),
    ({"negative_prompt": 3}, "negative_prompt: Input should be a valid string (got 3)"),
    ({"loras": "style"}, "loras: Input should be a valid list (got 'style')"),
])
def test_each_bad_field_is_named(fields, words):
    err = refused(generation(**fields))
    assert words in err.message
    assert err.param == next(iter(fields)) if fields else True


def test_several_problems_in_one_message_and_openai_shape():
    err = refused(json.dumps({"n": 0, "colour": "red"}).encode())
    assert "prompt is required" in err.message and "n: " in err.message and "unknown field 'colour'" in err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": err.param,
                                    "code": None}}
    assert refused(b"{not json").message.startswith("the body is not JSON")
    assert refused(b"[1, 2]").message == "the body must be a JSON object, got list"
    assert refused(b'{"prompt": "a", "guidance_scale": NaN}').param == "guidance_scale"


def test_edit_form_fields_parse_as_numbers():
    body = bodies.parse_edit({"prompt": "x", "n": "2", "strength": "0.5", "seed": "3",
                              "loras": '[{"name": "style", "scale": 0.8}]'})
    assert (body.n, body.strength, body.seed, body.loras) == (2, 0.5, 3, [{"name": "style", "scale": 0.8}])
    for fields, words in [({"strength": "0"}, "strength: Input should be greater than 0"),
                          ({"strength": "1.5"}, "strength: Input should be less than or equal to 1"),
                          ({"n": "two"}, "n: Input should be a valid integer"),
                          ({"loras": "[oops"}, "loras must be a JSON list"),
                          ({"colour": "red"}, "unknown field 'colour'")]:
        with pytest.raises(ApiError, match=None) as caught:
            bodies.parse_edit({"prompt": "x", **fields})
        assert words in caught.value.message and caught.value.status == 400


MODEL = ServedModel("sd15-tiny", "sd15", ("64x64", "96x64"), 8, ("txt2img",), frozenset({"PROMPT"}), 0)


def test_size_and_n_against_the_served_model():
    assert check_size(None, MODEL) == (64, 64)
    assert check_size("96x64", MODEL) == (96, 64)
    with pytest.raises(ApiError, match=r"size 128x128 is not served by sd15-tiny; served sizes: 64x64, 96x64"):
        check_size("128x128", MODEL)
    check_n(8, MODEL)
    with pytest.raises(ApiError, match="n is 9; sd15-tiny makes at most 8 images a request"):
        check_n(9, MODEL)


def test_settings_are_checked():
    assert ApiSettings("127.0.0.1:8001").check().host == "127.0.0.1"  # loopback unless told
    with pytest.raises(ServeError, match="--openai-port must be in 1..65535, got 70000; --api-key is empty"):
        ApiSettings("127.0.0.1:8001", port=70000, api_key=" ").check()
    with pytest.raises(ServeError, match="--triton-url is empty"):
        ApiSettings("").check()


def png(array: np.ndarray, mode: str, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array, mode).save(buffer, format=fmt)
    return buffer.getvalue()


def test_edit_images_follow_openai_transparency():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (8, 12, 3), dtype=np.uint8)
    image, mask = pngs.read_edit_inputs(png(rgb, "RGB"), None)
    assert np.array_equal(image, rgb) and mask is None  # opaque, no mask: img2img
    rgba = np.concatenate([rgb, np.full((8, 12, 1), 255, np.uint8)], axis=2)
    rgba[2:4, 3:5, 3] = 0  # a transparent hole: what to edit
    image, mask = pngs.read_edit_inputs(png(rgba, "RGBA"), None)
    assert np.array_equal(image, rgb) and mask[2, 3] == 255 and mask[0, 0] == 0 and mask.sum() == 4 * 255
    image, mask2 = pngs.read_edit_inputs(png(rgb, "RGB"), png(rgba, "RGBA"))
    assert np.array_equal(mask2, mask)
    with pytest.raises(ApiError, match="mask has no alpha channel"):
        pngs.read_edit_inputs(png(rgb, "RGB"), png(rgb, "RGB"))
    with pytest.raises(ApiError, match="mask is 6x8, the image 12x8: they must be the same size"):
        pngs.read_edit_inputs(png(rgb, "RGB"), png(rgba[:, :6].copy(), "RGBA"))
    with pytest.raises(ApiError, match="image is not a readable image"):
        pngs.read_edit_inputs(b"not an image", None)
    with pytest.raises(ApiError, match="image is an empty file"):
        pngs.read_edit_inputs(b"", None)
    with pytest.raises(ApiError, match="image is GIF; send a PNG"):
        pngs.read_edit_inputs(png(rgb[..., 0].copy(), "L", "GIF"), None)


def test_png_round_trip_keeps_pixels_and_request():
    from PIL import Image

    from trt_diffusion.image_files import ImageParameters

    rgb = np.random.default_rng(1).integers(0, 256, (16, 8, 3), dtype=np.uint8)
    data = pngs.encode_png(rgb, ImageParameters("a fox", 8, 16, 4, 7.5, 3, model="m"))
    with Image.open(io.BytesIO(data)) as image:
        assert np.array_equal(np.asarray(image), rgb)
        assert json.loads(image.text["trt_diffusion"])["seed"] == 3
