"""PNG text metadata (A1111 `parameters` + JSON) and output names that never overwrite."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from trt_diffusion.errors import ConfigError
from trt_diffusion.image_files import ImageParameters, output_paths, parse_a1111, read_png_parameters, save_png

PARAMS = ImageParameters(prompt="a lighthouse\nat dusk", width=64, height=96, steps=12, guidance_scale=5.5, seed=42,
                         negative_prompt="fog", scheduler="euler_a", model="sd15-tiny")


def test_round_trip_through_the_png(tmp_path):
    path = save_png(np.zeros((96, 64, 3), np.uint8), tmp_path / "a.png", PARAMS)
    assert read_png_parameters(path) == PARAMS
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary name


def test_an_a1111_text_alone_is_read(tmp_path):
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", "a cat, best quality\nNegative prompt: lowres\nSteps: 30, Sampler: DPM++ 2M, "
                                "CFG scale: 7, Seed: 1234, Size: 512x768, Model hash: abc, Model: v1-5")
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "webui.png", pnginfo=info)
    got = read_png_parameters(tmp_path / "webui.png")
    assert (got.prompt, got.negative_prompt, got.steps, got.guidance_scale, got.seed) == (
        "a cat, best quality", "lowres", 30, 7.0, 1234)
    assert (got.width, got.height, got.model) == (512, 768, "v1-5")


def test_our_text_reads_back_as_a1111(tmp_path):
    assert parse_a1111(PARAMS.a1111_text()) == ImageParameters(**{**PARAMS.__dict__})


@pytest.mark.parametrize("make,message", [
    (lambda p: p.write_bytes(b"not an image"), "not a readable image"),
    (lambda p: Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(p, format="PNG"), "no generation parameters"),
    (lambda p: Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(p, format="JPEG"), "not a PNG"),
])
def test_a_file_without_a_request_is_one_clear_error(tmp_path, make, message):
    path = tmp_path / "x.png"
    make(path)
    with pytest.raises(ConfigError, match=message):
        read_png_parameters(path)


def test_taken_names_get_the_next_numbers(tmp_path):
    out = tmp_path / "out.png"
    assert output_paths(out, 1) == [out]
    out.write_bytes(b"x")
    assert output_paths(out, 1) == [tmp_path / "out-0001.png"]
    assert output_paths(out, 1, overwrite=True) == [out]
    (tmp_path / "out-0001.png").write_bytes(b"x")
    assert output_paths(out, 2) == [tmp_path / "out-0.png", tmp_path / "out-1.png"]  # several: OUTPUT-i.png
    (tmp_path / "out-0.png").write_bytes(b"x")
    assert output_paths(out, 2) == [tmp_path / "out-0002.png", tmp_path / "out-0003.png"]


IMAGE_PARAMS = ImageParameters(prompt="a fox", width=64, height=64, steps=10, guidance_scale=7.5, seed=3,
                               workflow="inpaint", strength=0.75, init_image="photos/fox.png", mask="mask.png")


def test_an_image_request_records_its_workflow_strength_and_inputs(tmp_path):
    path = save_png(np.zeros((64, 64, 3), np.uint8), tmp_path / "a.png", IMAGE_PARAMS)
    assert read_png_parameters(path) == IMAGE_PARAMS
    text = IMAGE_PARAMS.a1111_text()
    assert text.endswith("Size: 64x64, Workflow: inpaint, Denoising strength: 0.75")  # A1111's name for strength
    got = parse_a1111(text)  # the settings line reads back; the file names live in the JSON only
    assert (got.workflow, got.strength, got.init_image) == ("inpaint", 0.75, None)
    assert "Workflow" not in PARAMS.a1111_text()  # a text-to-image PNG reads as before


def test_input_images_are_read_at_their_size_rgb_and_masks_grayscale(tmp_path):
    from trt_diffusion.image_files import read_input_image, read_mask

    rgba = np.zeros((24, 40, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, 10
    Image.fromarray(rgba).save(tmp_path / "rgba.png")
    image = read_input_image(tmp_path / "rgba.png")
    assert image.dtype == np.uint8 and image.shape == (24, 40, 3) and image[0, 0, 0] == 200  # alpha dropped
    white = np.full((24, 40, 3), 255, np.uint8)
    white[:, :20] = 0
    Image.fromarray(white).save(tmp_path / "mask.png")
    mask = read_mask(tmp_path / "mask.png")
    assert mask.shape == (24, 40) and mask[0, 0] == 0 and mask[0, 39] == 255
    with pytest.raises(ConfigError, match="--image .*nope.png: no such file"):
        read_input_image(tmp_path / "nope.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match="--mask .*bad.png: not a readable image"):
        read_mask(tmp_path / "bad.png")
