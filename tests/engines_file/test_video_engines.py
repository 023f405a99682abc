"""Video (wan) in engines.yaml: the engine matrix `plan` counts and explains (transformer_2 for a two-expert folder,
a VAE decoder per frame count), and WIDTHxHEIGHTxFRAMES buckets refused at file:line where they are wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trt_diffusion import api
from trt_diffusion.cli import main
from trt_diffusion.engines_file.engine_spec import Size
from trt_diffusion.precision import Precision

BUCKETS = ["32x32x5", "48x32x9"]
TARGETS = ["onnxruntime", "openvino"]


def wan_config(tmp_path: Path, model_dir: Path, **fields) -> Path:
    model = {"source": str(model_dir), "family": "wan", "buckets": BUCKETS, "batch": [1],
             "precision": {"text_encoder": "fp32", "transformer": "fp32", "vae_decoder": "fp32"},
             "targets": TARGETS, **fields}
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": {"wan": model}}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def wan21(tiny_model_factory) -> Path:
    return tiny_model_factory("wan")


@pytest.fixture(scope="module")
def wan22(tiny_model_factory) -> Path:
    return tiny_model_factory("wan", variant="two_expert")


def test_wan21_plan_counts_the_video_engines(tmp_path, wan21):
    plan = api.plan(wan_config(tmp_path, wan21))
    for target in TARGETS:
        assert plan.count("wan", "text_encoder", target) == 1  # no resolution, no frames
        assert plan.count("wan", "transformer", target) == 2  # one per bucket (CFG batched: batch 2)
        assert plan.count("wan", "vae_decoder", target) == 2
        assert plan.count("wan", "transformer_2", target) == 0  # a Wan 2.1 folder has one expert
    assert plan.total_engines == 10
    transformers = [s for s in plan.specs if s.component == "transformer" and s.target == "onnxruntime"]
    assert [s.name for s in transformers] == ["wan.transformer.32x32x5.b2.fp32", "wan.transformer.48x32x9.b2.fp32"]
    vae = next(r for r in plan.rows if r.component == "vae_decoder" and r.target == "onnxruntime")
    assert vae.formula == ("2 buckets (32x32x5, 48x32x9) × 1 batch shape (1); each engine at one frame count "
                           "(5, 9: the whole-clip VAE fixes it)")
    for row in plan.rows:  # the weights once per engine: unrolling the clip's frames copies no weight
        assert row.parameters and row.disk_bytes == row.engines * row.parameters * 4, row
    assert plan.workflows["wan"] == {"txt2img": "the text-to-video engines"}


def test_a_two_expert_folder_adds_transformer_2(tmp_path, wan22):
    plan = api.plan(wan_config(tmp_path, wan22))
    for target in TARGETS:
        assert plan.count("wan", "transformer", target) == plan.count("wan", "transformer_2", target) == 2
    assert plan.total_engines == 14
    assert plan.config.models["wan"].components[:3] == ("text_encoder", "transformer", "transformer_2")
    # transformer_2 was not given a precision: it follows transformer's (one architecture), not the fp16 default
    assert {s.precision for s in plan.specs if s.component == "transformer_2"} == {Precision.fp32}


def test_a_frame_range_gives_one_transformer_and_a_vae_decoder_per_frame_count(tmp_path, wan22):
    path = wan_config(tmp_path, wan22, buckets=[{"min": "32x32x5", "opt": "32x32x9", "max": "48x32x17"}],
                      targets=["onnxruntime"])
    plan = api.plan(path)
    assert plan.count("wan", "transformer") == plan.count("wan", "transformer_2") == 1
    vae = [s for s in plan.specs if s.component == "vae_decoder"]
    assert [(s.bucket.min, s.bucket.opt, s.bucket.max) for s in vae] == [
        tuple(Size.parse(f"{side}x{frames}") for side in ("32x32", "32x32", "48x32")) for frames in (5, 9, 13, 17)]
    assert vae[1].reasons == ("bucket 32x32x5..48x32x17 × 9 frames (the whole-clip VAE fixes its frame count) "
                              "× batch 1",)
    assert len({s.key for s in vae}) == 4


def _plan_error(path: Path, capsys) -> str:
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_frames_off_the_4k_plus_1_grid_are_refused_at_their_line(tmp_path, capsys, wan21):
    path = wan_config(tmp_path, wan21, buckets=["32x32x5", "32x32x6"])
    message = _plan_error(path, capsys)
    line = _line_of(path, "32x32x6")
    assert f"{path}:{line}:" in message.replace(" ", "") or f"{path}:{line}:" in message
    assert "models.wan.buckets.1" in message
    assert "6 frames is not 4k+1" in message and "use 5 or 9" in message


def test_frames_on_an_image_family_are_refused_at_their_line(tmp_path, capsys, tiny_model_factory):
    path = tmp_path / "engines.yaml"
    path.write_text(f"version: 1\nmodels:\n  m:\n    source: {tiny_model_factory('sd15')}\n    family: sd15\n"
                    "    buckets: ['64x64x5']\n")
    message = _plan_error(path, capsys)
    assert f"{path}:6:" in message and "models.m.buckets.0" in message
    assert "64x64x5 has a frame count, but sd15 is an image family: write 64x64" in message


def test_a_video_bucket_without_frames_is_refused(tmp_path, capsys, wan21):
    message = _plan_error(wan_config(tmp_path, wan21, buckets=["32x32"]), capsys)
    assert "models.wan.buckets.0" in message and "32x32 has no frame count: wan is a video family" in message


def test_components_must_match_the_folders_experts(tmp_path, capsys, wan21, wan22):
    one_of_two = wan_config(tmp_path, wan22, components=["text_encoder", "transformer", "vae_decoder"])
    message = _plan_error(one_of_two, capsys)
    assert f"{one_of_two}:{_line_of(one_of_two, 'components:')}:" in message
    assert "this checkpoint has two experts" in message and "add transformer_2 to components" in message
    (tmp_path / "b").mkdir()
    absent = wan_config(tmp_path / "b", wan21, components=["text_encoder", "transformer", "transformer_2",
                                                            "vae_decoder"])
    assert "this checkpoint has no transformer_2" in _plan_error(absent, capsys)
