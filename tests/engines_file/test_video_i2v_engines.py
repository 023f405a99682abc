"""Image-to-video (wan img2vid) in engines.yaml: an I2V checkpoint serves img2vid only and adds its VAE encoder
(one per frame count, batch 1) and, for Wan 2.1 I2V, its CLIP image encoder; the wrong workflow for a checkpoint is
refused at file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines_file.test_video_engines import _line_of, _plan_error, wan_config
from trt_diffusion import api
from trt_diffusion.workflows import Workflow


@pytest.fixture(scope="module")
def wan21_i2v(tiny_model_factory) -> Path:
    return tiny_model_factory("wan", variant="i2v")


@pytest.fixture(scope="module")
def wan22_i2v(tiny_model_factory) -> Path:
    return tiny_model_factory("wan", variant="i2v_two_expert")


def _counts(plan, target="onnxruntime") -> dict[str, int]:
    counts: dict[str, int] = {}
    for spec in plan.specs:
        if spec.target == target:
            counts[spec.component] = counts.get(spec.component, 0) + 1
    return counts


def test_wan21_i2v_serves_img2vid_with_its_image_and_vae_encoders(tmp_path, wan21_i2v):
    plan = api.plan(wan_config(tmp_path, wan21_i2v))
    assert plan.config.models["wan"].workflows == (Workflow.img2vid,)
    # two buckets of different frame counts: a VAE encoder and decoder each per count, one image encoder
    assert _counts(plan) == {"text_encoder": 1, "image_encoder": 1, "transformer": 2, "vae_encoder": 2,
                             "vae_decoder": 2}
    encoders = [s for s in plan.specs if s.component == "vae_encoder" and s.target == "onnxruntime"]
    assert [(s.batch, s.bucket.min.frames) for s in encoders] == [(1, 5), (1, 9)]
    note = plan.workflows["wan"]["img2vid"]
    assert "CLIP image encoder" in note and "36 input channels" in note


def test_wan22_i2v_has_two_experts_and_no_image_encoder(tmp_path, wan22_i2v):
    plan = api.plan(wan_config(tmp_path, wan22_i2v))
    assert _counts(plan) == {"text_encoder": 1, "transformer": 2, "transformer_2": 2, "vae_encoder": 2,
                             "vae_decoder": 2}
    assert "CLIP" not in plan.workflows["wan"]["img2vid"]


def test_img2vid_on_a_text_to_video_checkpoint_is_refused_at_its_line(tmp_path, capsys, tiny_model_factory):
    path = wan_config(tmp_path, tiny_model_factory("wan"), workflows=["img2vid"])
    message = _plan_error(path, capsys)
    assert f"{path}:{_line_of(path, '- img2vid')}:" in message and "models.wan.workflows.0" in message
    assert "img2vid needs an image-to-video checkpoint (WanImageToVideoPipeline" in message


def test_text_to_video_on_an_i2v_checkpoint_is_refused(tmp_path, capsys, wan21_i2v):
    message = _plan_error(wan_config(tmp_path, wan21_i2v, workflows=["txt2img"]), capsys)
    assert "models.wan.workflows.0" in message
    assert "a WanImageToVideoPipeline checkpoint's transformer takes the conditioning image's latents" in message
    assert "36 input channels" in message and "runs img2vid only" in message


def test_a_components_list_without_the_image_encoder_is_refused(tmp_path, capsys, wan21_i2v):
    path = wan_config(tmp_path, wan21_i2v, components=["text_encoder", "transformer", "vae_decoder"])
    message = _plan_error(path, capsys)
    assert f"{path}:{_line_of(path, 'components:')}:" in message
    assert "add image_encoder, vae_encoder to components" in message


def test_img2vid_is_a_wan_workflow_only(tmp_path, capsys, tiny_model_factory):
    path = tmp_path / "engines.yaml"
    path.write_text(f"version: 1\nmodels:\n  m:\n    source: {tiny_model_factory('sd15')}\n    family: sd15\n"
                    "    workflows: [img2vid]\n")
    message = _plan_error(path, capsys)
    assert "the sd15 family cannot run img2vid (families that can: wan)" in message
