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
