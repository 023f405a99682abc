"""`generate --config engines.yaml`: the built engines in the CLI's own process (no server), as TensorRT's
diffusion demo runs them; the PNG equals the EnginePipeline's image over the same engines."""

from __future__ import annotations

import numpy as np
from PIL import Image

from trt_diffusion.cli import main
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.image_files import read_png_parameters
from trt_diffusion.runtime.loader import built_engines, table_from_engines
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest


def test_generate_with_config_runs_the_built_engines_in_process(built_sd15, tmp_path):
    out = tmp_path / "local.png"
    assert main(["generate", "--config", str(built_sd15), "--prompt", "a red fox", "--height", "64", "--width", "64",
                 "--steps", "3", "--seed", "9", "--guidance-scale", "1.0", "-o", str(out)]) == 0
    config = load_engines_file(built_sd15)
    (name,) = config.models
    model = config.models[name]
    pipeline = EnginePipeline(model.source.path, model.family, table_from_engines(built_engines(config, name,
                                                                                                "onnxruntime")))
    expected = pipeline.generate(GenerationRequest(prompt="a red fox", height=64, width=64, steps=3, seed=9,
                                                   guidance_scale=1.0)).images[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), expected)
    assert read_png_parameters(out).model == name


def test_generate_with_config_and_no_size_draws_the_first_bucket(built_sd15, tmp_path):
    """As a request to a server gets the server's first served size."""
    out = tmp_path / "sized.png"
    assert main(["generate", "--config", str(built_sd15), "--prompt", "x", "--steps", "2", "-o", str(out)]) == 0
    config = load_engines_file(built_sd15)
    (model,) = config.models.values()
    first = model.buckets[0].opt
    assert Image.open(out).size == (first.width, first.height)


def test_generate_with_config_and_an_unknown_model_names_it(built_sd15, capsys):
    assert main(["generate", "--config", str(built_sd15), "--model", "nope", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err
