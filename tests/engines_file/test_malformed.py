"""Every malformed engines.yaml gets exit 1, the file:line and the field in the message, no traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trt_diffusion.cli import main

GOOD_MODEL = """\
  m:
    source: {source}
    family: sd15
"""


def write(tmp_path: Path, body: str, model_dir: Path) -> Path:
    path = tmp_path / "engines.yaml"
    path.write_text(textwrap.dedent(body).replace("{source}", str(model_dir)))
    return path


CASES = [
    # (id, yaml, expected line, expected fragments)
    ("yaml-syntax", "version: 1\nmodels:\n  m: [unclosed\n", 4, ["YAML syntax error"]),
    ("unknown-top-key", "version: 1\nmodelz: {}\nmodels:\n" + GOOD_MODEL, 2, ["modelz", "unknown key"]),
    ("unknown-model-key", "version: 1\nmodels:\n" + GOOD_MODEL + "    colour: red\n", 6, ["models.m.colour", "unknown key"]),
    ("bucket-not-multiple", "version: 1\nmodels:\n" + GOOD_MODEL + "    buckets: ['512x512', '500x512']\n", 6,
     ["models.m.buckets.1", "500x512", "multiple of 8"]),
    ("sd3-needs-16", "version: 1\nmodels:\n  m:\n    source: {source}\n    family: sd3\n    buckets: ['520x520']\n",
     6, ["models.m.buckets.0", "multiple of 16", "sd3"]),
    ("min-gt-opt", "version: 1\nmodels:\n" + GOOD_MODEL
     + "    buckets:\n      - {min: 768x768, opt: 512x512, max: 1024x1024}\n", 7,
     ["models.m.buckets.0.min", "larger than opt"]),
    ("opt-gt-max", "version: 1\nmodels:\n" + GOOD_MODEL
     + "    buckets:\n      - {min: 512x512, opt: 1024x1024, max: 768x768}\n", 7,
     ["models.m.buckets.0.opt", "larger than max"]),
    ("batch-zero", "version: 1\nmodels:\n" + GOOD_MODEL + "    batch: [1, 0]\n", 6, ["models.m.batch.1", "greater than or equal to 1"]),
    ("unknown-family", "version: 1\nmodels:\n  m:\n    source: {source}\n    family: sd9\n", 5, ["models.m.family", "'sd9'"]),
    ("unknown-component", "version: 1\nmodels:\n" + GOOD_MODEL + "    components: [unet, refiner]\n", 6,
     ["models.m.components.1", "'refiner'"]),
    ("component-family-lacks", "version: 1\nmodels:\n" + GOOD_MODEL + "    components: [unet, transformer]\n", 6,
     ["models.m.components.1", "sd15 family has no transformer"]),
    ("controlnet-on-flux", "version: 1\nmodels:\n  m:\n    source: {source}\n    family: flux\n"
     "    buckets: ['512x512']\n    controlnets:\n      canny: {source: {source}/controlnet}\n", 7,
     ["models.m.controlnets", "flux family has no ControlNet"]),
    ("duplicate-model", "version: 1\nmodels:\n" + GOOD_MODEL + GOOD_MODEL, 6, ["models.m", "duplicate key"]),
    ("missing-source-folder", "version: 1\nmodels:\n  m:\n    source: does/not/exist\n    family: sd15\n", 4,
     ["models.m.source", "not found"]),
    ("unknown-precision", "version: 1\nmodels:\n" + GOOD_MODEL + "    precision: {unet: fp4}\n", 6,
     ["models.m.precision.unet", "'fp4'"]),
    ("missing-family", "version: 1\nmodels:\n  m:\n    source: {source}\n", 3, ["models.m.family", "required"]),
    ("bad-version", "version: 2\nmodels:\n" + GOOD_MODEL, 1, ["version"]),
    ("bad-size-text", "version: 1\nmodels:\n" + GOOD_MODEL + "    buckets: ['big']\n", 6, ["models.m.buckets.0", "WIDTHxHEIGHT"]),
    ("quantized-vae", "version: 1\nmodels:\n" + GOOD_MODEL + "    precision: {vae_decoder: int8}\n", 6,
     ["models.m.precision.vae_decoder", "int8 is for unet; the quantize stage does not quantize vae_decoder"]),
    ("opset-too-old", "version: 1\nbuild: {opset: 13}\nmodels:\n" + GOOD_MODEL, 2, ["build.opset", "greater than or equal to 18"]),
    # what `plan` let through before (a plan of text encoders only), and what it said in pydantic's words
    ("empty-buckets", "version: 1\nmodels:\n" + GOOD_MODEL + "    buckets: []\n", 6,
     ["models.m.buckets", "at least one"]),
    ("empty-targets", "version: 1\nmodels:\n" + GOOD_MODEL + "    targets: []\n", 6,
     ["models.m.targets", "at least one"]),
    ("family-not-the-folders", "version: 1\nmodels:\n  m:\n    source: {source}\n    family: sdxl\n", 5,
     ["models.m.family", "StableDiffusionPipeline", "family sd15", "set family: sd15"]),
    ("did-you-mean", "version: 1\nmodels:\n" + GOOD_MODEL + "    bucket: ['512x512']\n", 6,
     ["models.m.bucket", "unknown key", "did you mean 'buckets'"]),
    ("version-in-our-words", "version: 2\nmodels:\n" + GOOD_MODEL, 1, ["reads version: 1"]),
]


@pytest.mark.parametrize("case_id,body,line,fragments", CASES, ids=[c[0] for c in CASES])
def test_malformed_file_is_one_clear_error(tmp_path, capsys, tiny_sd15_dir, case_id, body, line, fragments):
    path = write(tmp_path, body, tiny_sd15_dir)
    code = main(["plan", str(path)])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    message = " ".join(captured.err.split())  # rich may wrap long lines
    assert f"{path}:{line}" in message.replace(" ", "") or f"{path}:{line}:" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_all_problems_of_a_file_are_reported_together(tmp_path, capsys, tiny_sd15_dir):
    body = ("version: 1\nmodels:\n" + GOOD_MODEL + "    batch: [0]\n    buckets: ['500x500']\n    colour: red\n")
    path = write(tmp_path, body, tiny_sd15_dir)
    assert main(["plan", str(path)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "3 problems" in err
    for fragment in ("models.m.batch.0", "models.m.buckets.0", "models.m.colour"):
        assert fragment in err


def test_debug_shows_the_traceback(tmp_path, capsys, tiny_sd15_dir):
    path = write(tmp_path, "version: 1\nmodels:\n" + GOOD_MODEL + "    colour: red\n", tiny_sd15_dir)
    assert main(["--debug", "plan", str(path)]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_missing_file(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_a_bad_bucket_is_one_message_in_the_files_words(tmp_path, capsys, tiny_sd15_dir):
    path = write(tmp_path, "version: 1\nmodels:\n" + GOOD_MODEL + "    buckets: ['64by64', [64]]\n", tiny_sd15_dir)
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert "2 problems" in err, err  # one per bucket, not one per union branch
    assert "Input should be" not in err and "RangeBucket" not in err
    assert "expected WIDTHxHEIGHT like '512x512' (or WIDTHxHEIGHTxFRAMES for video, '832x480x81'), got '64by64'" in err and "a bucket is 'WIDTHxHEIGHT'" in err


def test_a_missing_lora_file_is_reported_with_the_schema_errors(tmp_path, capsys, tiny_sd15_dir):
    body = ("version: 1\nmodels:\n" + GOOD_MODEL + "    colour: red\n    loras:\n"
            "      style: {source: nowhere.safetensors}\n")
    assert main(["plan", str(write(tmp_path, body, tiny_sd15_dir))]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "2 problems" in err and "models.m.colour" in err and "LoRA file 'nowhere.safetensors' not found" in err


def test_a_folder_instead_of_the_file_is_named(tmp_path, capsys, tiny_sd15_dir):
    write(tmp_path, "version: 1\nmodels:\n" + GOOD_MODEL, tiny_sd15_dir)
    assert main(["plan", str(tmp_path)]) == 1
    assert f"{tmp_path} is a folder: did you mean {tmp_path / 'engines.yaml'}?" in " ".join(
        capsys.readouterr().err.split())
