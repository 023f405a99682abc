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
            "batch": [1], "components": [*COMPONENTS, "vae_encoder"], "targets": TARGETS,
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
        # one per bucket, batch 1: the family's true CFG calls it over the request's rows (#42: its default `split`)
        assert plan.count("qwen", "transformer", target) == 2
        assert plan.count("qwen", "vae_decoder", target) == 2
        assert plan.count("qwen", "vae_encoder", target) == 2  # listed: batch 1, one per bucket
    assert plan.count("flux", "transformer") == 1
    qwen_rows = [r for r in plan.rows if r.model == "qwen"]
    assert len(qwen_rows) == 8 and sum(r.engines for r in qwen_rows) == 14
    for row in qwen_rows:  # fp32 weights once per engine
        assert row.parameters and row.disk_bytes == row.engines * row.parameters * 4, row
    transformer = next(r for r in qwen_rows if r.component == "transformer" and r.target == "onnxruntime")
    assert transformer.formula.startswith("2 buckets (64x64, 128x96)")
    names = [s.name for s in plan.specs if s.model == "qwen" and s.target == "onnxruntime"]
    assert "qwen.text_encoder.b1.fp32" in names and "qwen.transformer.128x96.b1.fp32" in names
    assert plan.total_engines == sum(r.engines for r in plan.rows)


def test_the_plan_command_lists_them(manifest, capsys):
    assert main(["plan", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert out.count("qwen ") >= 8 and "text_encoder" in out and "vae_encoder" in out


def test_image_workflows_add_the_vae_encoder(manifest, tmp_path):
    """`workflows: [txt2img, img2img, inpaint]` is accepted for qwen_image (QwenImageImg2Img/InpaintPipeline) and
    brings the VAE encoder, batch 1, into the matrix, with the reason plan gives every family."""
    from trt_diffusion.engines_file import expand, load_engines_file
    from trt_diffusion.workflows import Workflow

    path = _with(manifest, tmp_path, "qwen", workflows=["txt2img", "img2img", "inpaint"])
    model = load_engines_file(path).models["qwen"]
    assert model.workflows == (Workflow.txt2img, Workflow.img2img, Workflow.inpaint)
    encoders = [s for s in expand(load_engines_file(path)) if s.model == "qwen" and s.component == "vae_encoder"]
    assert sorted({(s.bucket.label, s.batch) for s in encoders}) == [("128x96", 1), ("64x64", 1)]
    assert "init image (img2img, inpaint)" in encoders[0].reasons[0]


def _with(manifest: Path, tmp_path: Path, model: str, **fields) -> Path:
    document = yaml.safe_load(manifest.read_text())
    document["models"][model].update(fields)
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_text_length_sets_the_text_axis_profile(manifest, tmp_path, tiny_model_factory):
    """engines.yaml's text_length is the encoder's and the transformer's text range (their keys change with it);
    the VAE's engines and a file that leaves it out (or gives the default) keep their keys."""
    from trt_diffusion.components import get_component, load_model_config

    default = {s.key: s for s in api.plan(manifest).specs}
    plan = api.plan(_with(manifest, tmp_path, "qwen", text_length={"min": 8, "opt": 64, "max": 256}))
    changed = {s.component.value for s in plan.specs if s.key not in default}
    assert changed == {"text_encoder", "transformer"}
    same = api.plan(_with(manifest, tmp_path, "qwen", text_length={"min": 2, "opt": 128, "max": 512}))
    assert {s.key for s in same.specs} == set(default)
    folder = tiny_model_factory("qwen_image")
    encoder = next(s for s in plan.specs if s.component == "text_encoder" and s.target == "onnxruntime")
    profile = get_component("qwen_image", "text_encoder").profile(
        encoder, load_model_config(folder, "qwen_image", "text_encoder"))
    assert profile["input_ids"] == ((1, 42), (1, 98), (1, 290))  # the template's 34 + 8 / 64 / 256
    transformer = next(s for s in plan.specs if s.component == "transformer" and s.target == "onnxruntime")
    profile = get_component("qwen_image", "transformer").profile(
        transformer, load_model_config(folder, "qwen_image", "transformer"))
    assert profile["encoder_hidden_states_mask"] == ((1, 8), (1, 64), (1, 256))  # batch 1: true CFG's calls


@pytest.mark.parametrize("model,text_length,message", [
    ("flux", {"min": 8, "opt": 64, "max": 256}, "the flux family pads every prompt to one length"),
    ("qwen", {"min": 64, "opt": 8, "max": 256}, "needs min <= opt <= max, got 64, 8, 256"),
    ("qwen", {"min": 8, "opt": 64, "max": 2048}, "more than QwenImagePipeline's max_sequence_length limit (1024)"),
    ("qwen", {"min": 1, "opt": 64, "max": 256}, "greater than or equal to 2"),
])
def test_a_wrong_text_length_is_refused_at_its_line(manifest, tmp_path, capsys, model, text_length, message):
    path = _with(manifest, tmp_path, model, text_length=text_length)
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err and f"{path}:" in err and "text_length" in err and "Traceback" not in err


def test_the_text_encoder_counts_its_language_model_only(manifest, tiny_model_factory):
    """The text_encoder folder is the whole Qwen2.5-VL; its engine is the language model (no vision tower, no LM
    head), which is what plan counts and sizes."""
    from trt_diffusion.models.loading import load_component

    module = load_component(tiny_model_factory("qwen_image"), "text_encoder")
    language = sum(p.numel() for name, p in module.named_parameters()
                   if not name.startswith(("lm_head.", "model.visual.", "visual.")))
    row = next(r for r in api.plan(manifest).rows if r.model == "qwen" and r.component == "text_encoder")
    assert row.parameters == language < sum(p.numel() for p in module.parameters())


def _edit_manifest(tmp_path, tiny_model_factory, **change) -> Path:
    model = {"source": str(tiny_model_factory("qwen_image", variant="edit")), "family": "qwen_image",
             "buckets": ["64x64", "64x96", "96x64"], "cfg": ["split"], "targets": ["onnxruntime"]}
    model.update(change)
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": {"q": model}}, sort_keys=False))
    return path


def test_an_edit_checkpoint_plans_its_reference_grid_per_bucket(tmp_path, tiny_model_factory):
    """A QwenImageEditPipeline folder edits by default: the vision tower (image_encoder) and the VAE encoder join,
    and every reference-dependent engine is per bucket, its build options fixing the reference image's resized size
    (about 1024² at the bucket's aspect) and its image tokens in the prompt (the processor's grid / 4)."""
    from trt_diffusion.engines_file import expand, load_engines_file

    config = load_engines_file(_edit_manifest(tmp_path, tiny_model_factory), check_sources=True)
    model = config.models["q"]
    assert [w.value for w in model.workflows] == ["edit"]
    assert {c.value for c in model.components} == {"text_encoder", "image_encoder", "transformer", "vae_encoder",
                                                   "vae_decoder"}
    specs = [s for s in expand(config) if s.model == "q"]
    expected = {"64x64": ("1024x1024", "1369"), "64x96": ("832x1248", "1350"), "96x64": ("1248x832", "1350")}
    for component in ("text_encoder", "image_encoder", "transformer", "vae_encoder"):
        chosen = [s for s in specs if s.component.value == component]
        assert sorted(s.bucket.label for s in chosen) == sorted(expected), component
        for spec in chosen:
            assert (spec.option("context_size"), spec.option("context_tokens")) == expected[spec.bucket.label]
    assert all(s.option("context_size") is None for s in specs if s.component.value == "vae_decoder")


@pytest.mark.parametrize("change,line,message", [
    ({"buckets": [{"min": "64x64", "opt": "64x64", "max": "64x128"}]}, "models.q.buckets.0",
     "edit: bucket 64x64..64x128 spans reference images of several resized sizes"),
    ({"precision": {"transformer": "int8"}}, "models.q.precision",
     "edit: transformer at fp8/int8 is not supported for Qwen-Image-Edit yet"),
])
def test_what_an_edit_model_cannot_build_is_refused_at_its_line(tmp_path, tiny_model_factory, capsys, change, line,
                                                                message):
    assert main(["plan", str(_edit_manifest(tmp_path, tiny_model_factory, **change))]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"{line}: {message}" in err and "Traceback" not in err
