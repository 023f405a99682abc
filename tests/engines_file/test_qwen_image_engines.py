"""Qwen-Image in engines.yaml: the engine matrix `plan` counts (a text encoder per batch, no bucket: its text length
is a profile dimension; a transformer per bucket and CFG batch; the VAE halves per bucket), with parameters and
disk, on a manifest that holds it beside another family."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trt_diffusion import api
from trt_diffusion.cli import main

TARGETS = ["onnxruntime", "openvino"]
COMPONENTS = ["text_encoder", "transformer", "vae_decoder"]


@pytest.fixture(scope="module")
def manifest(tiny_model_factory, tmp_path_factory) -> Path:
    qwen = {"source": str(tiny_model_factory("qwen_image")), "family": "qwen_image", "buckets": ["64x64", "128x96"],
            "batch": [1], "workflows": ["txt2img", "img2img"], "targets": TARGETS,
            "precision": {c: "fp32" for c in (*COMPONENTS, "vae_encoder")}}
    flux = {"source": str(tiny_model_factory("flux")), "family": "flux", "buckets": ["64x64"], "batch": [1],
            "targets": ["onnxruntime"]}
    path = tmp_path_factory.mktemp("qwen-plan") / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": {"qwen": qwen, "flux": flux}}, sort_keys=False))
    return path


def test_plan_counts_the_qwen_image_engines_with_disk(manifest):
    plan = api.plan(manifest)
    for target in TARGETS:
        assert plan.count("qwen", "text_encoder", target) == 1  # no bucket; its text length is a profile dim
        assert plan.count("qwen", "transformer", target) == 2  # one per bucket (the CFG batch: batch 2)
        assert plan.count("qwen", "vae_decoder", target) == 2
        assert plan.count("qwen", "vae_encoder", target) == 2  # img2img's init image, batch 1
    assert plan.count("flux", "transformer") == 1
    qwen_rows = [r for r in plan.rows if r.model == "qwen"]
    assert len(qwen_rows) == 8 and sum(r.engines for r in qwen_rows) == 14
    for row in qwen_rows:  # fp32 weights once per engine
        assert row.parameters and row.disk_bytes == row.engines * row.parameters * 4, row
    transformer = next(r for r in qwen_rows if r.component == "transformer" and r.target == "onnxruntime")
    assert transformer.formula.startswith("2 buckets (64x64, 128x96)")
    names = [s.name for s in plan.specs if s.model == "qwen" and s.target == "onnxruntime"]
    assert "qwen.text_encoder.b1.fp32" in names and "qwen.transformer.128x96.b2.fp32" in names
    assert plan.total_engines == sum(r.engines for r in plan.rows)


def test_the_plan_command_lists_them(manifest, capsys):
    assert main(["plan", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert out.count("qwen ") >= 8 and "text_encoder" in out and "vae_encoder" in out
