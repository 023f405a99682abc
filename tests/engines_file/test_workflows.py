"""`workflows:` in engines.yaml: what each adds to the plan, and every mistake as one file:line error."""

from __future__ import annotations

import textwrap

import pytest

from trt_diffusion.cli import main
from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.families import Component
from trt_diffusion.workflows import Workflow


def write(tmp_path, body: str, source, family="sd15") -> str:
    path = tmp_path / "engines.yaml"
    path.write_text(textwrap.dedent(f"""\
        version: 1
        models:
          m:
            source: {source}
            family: {family}
            buckets: ['64x64', '128x128']
            batch: [1, 2]
        """) + textwrap.indent(textwrap.dedent(body), "    "))
    return str(path)


def test_default_is_txt2img_and_adds_no_encoder(tmp_path, tiny_sd15_dir):
    model = load_engines_file(write(tmp_path, "", tiny_sd15_dir)).models["m"]
    assert model.workflows == (Workflow.txt2img,)
    assert Component.vae_encoder not in model.components


def test_image_workflows_add_one_vae_encoder_per_bucket(tmp_path, tiny_sd15_dir):
    config = load_engines_file(write(tmp_path, "workflows: [txt2img, img2img, inpaint]\n", tiny_sd15_dir))
    model = config.models["m"]
    assert model.workflows == (Workflow.txt2img, Workflow.img2img, Workflow.inpaint)
    encoders = [s for s in expand(config) if s.component == "vae_encoder"]
    # the init image is encoded once per request at batch 1, whatever the image batch: one per bucket and target
    assert sorted({(s.bucket.label, s.batch) for s in encoders}) == [("128x128", 1), ("64x64", 1)]
    assert "init image (img2img, inpaint)" in encoders[0].reasons[0]
    denoisers = [s for s in expand(config) if s.component == "unet"]
    txt_only = [s for s in expand(load_engines_file(write(tmp_path, "", tiny_sd15_dir))) if s.component == "unet"]
    assert {s.key for s in denoisers} == {s.key for s in txt_only}  # no extra denoiser: same schedule, trimmed


def test_plan_says_what_each_workflow_adds(tmp_path, tiny_sd15_dir, capsys):
    path = write(tmp_path, "workflows: [txt2img, img2img, inpaint]\n", tiny_sd15_dir)
    encoders = sum(1 for s in expand(load_engines_file(path)) if s.component == "vae_encoder")
    assert main(["plan", path]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"m workflow img2img: the VAE encoder ({encoders} engines: one per bucket and target, batch 1)" in out
    assert "m workflow inpaint: the VAE encoder" in out and "mask blending on the 4-channel unet" in out


def test_an_inpainting_checkpoint_defaults_to_inpaint(tmp_path, tiny_model_factory, capsys):
    folder = tiny_model_factory("sd15", variant="inpaint")
    model = load_engines_file(write(tmp_path, "", folder)).models["m"]
    assert model.workflows == (Workflow.inpaint,) and Component.vae_encoder in model.components
    assert main(["plan", write(tmp_path, "", folder)]) == 0
    assert "the checkpoint's 9-channel inpainting unet" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("body,family,line,fragments", [
    ("workflows: [img2img, outpaint]\n", "sd15", 8, ["models.m.workflows.1", "'outpaint' is not one of 'txt2img'",
                                                     "'edit'"]),
    ("workflows: [edit]\n", "sd15", 8, ["models.m.workflows.0", "sd15 family cannot run edit",
                                        "families that can: flux"]),
    ("workflows: []\n", "sd15", 8, ["models.m.workflows", "at least one"]),
    ("components: [text_encoder, unet, vae_decoder]\nworkflows: [img2img]\n", "sd15", 8,
     ["models.m.components", "encode the init image: add vae_encoder to components"]),
])
def test_workflow_mistakes_are_file_line_errors(tmp_path, tiny_sd15_dir, capsys, body, family, line, fragments):
    assert main(["plan", write(tmp_path, body, tiny_sd15_dir, family)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"engines.yaml:{line}" in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_edit_on_a_plain_flux_checkpoint_names_what_it_needs(tmp_path, tiny_model_factory, capsys):
    path = write(tmp_path, "workflows: [edit]\n", tiny_model_factory("flux"), "flux")
    assert main(["plan", path]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "edit: edit needs an editing checkpoint (FluxKontextPipeline in model_index.json" in err


def test_txt2img_on_an_inpainting_checkpoint_is_refused(tmp_path, tiny_model_factory, capsys):
    path = write(tmp_path, "workflows: [txt2img, inpaint]\n", tiny_model_factory("sd15", variant="inpaint"))
    assert main(["plan", path]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "models.m.workflows.0" in err and "takes 9 input channels (an inpainting checkpoint)" in err


def test_a_kontext_checkpoint_edits_with_twice_the_image_tokens(tmp_path, tiny_model_factory, capsys):
    from trt_diffusion.components import get_component, load_model_config

    folder = tiny_model_factory("flux", variant="kontext")
    path = write(tmp_path, "", folder, "flux")
    config = load_engines_file(path)
    model = config.models["m"]
    assert model.workflows == (Workflow.edit,) and Component.vae_encoder in model.components
    spec = next(s for s in expand(config) if s.component == "transformer" and s.bucket.label == "64x64")
    assert spec.option("context_image") is True
    profile = get_component("flux", "transformer").profile(spec, load_model_config(folder, "flux", "transformer"))
    tokens = (64 // 16) * (64 // 16)  # the bucket's packed latent tokens
    assert profile["hidden_states"][1][1] == 2 * tokens and profile["img_ids"][1][0] == 2 * tokens
    assert main(["plan", path]) == 0
    assert "m workflow edit: the VAE encoder" in " ".join(capsys.readouterr().out.split())
