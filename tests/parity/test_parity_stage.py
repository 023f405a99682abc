"""`parity` against real built engines: passes when they are right, fails naming the component when not."""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser

import numpy as np
import onnx
import pytest
import yaml

from trt_diffusion.cli import main
from trt_diffusion.onnx_facts import onnx_sha256
from trt_diffusion.workspace.manifests import record_files


def _copy_config(tmp_path, built_sd15):
    workspace = tmp_path / "build"
    shutil.copytree(built_sd15.parent / "build", workspace, ignore=shutil.ignore_patterns("reports"))
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(workspace)
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, workspace


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.rows, self.tables = [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        self.rows += tag == "tr"
        self.tables += tag == "table"


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory, built_sd15):
    out = tmp_path_factory.mktemp("parity-report")
    code = main(["parity", str(built_sd15), "--steps", "2", "--out", str(out)])
    return code, out


def test_engines_pass_parity_and_the_reports_are_complete(parity_run):
    code, out = parity_run
    assert code == 0
    report = json.loads((out / "parity.json").read_text())
    assert report["schema_version"] == 1 and report["passed"] is True
    ids = sorted(v["variant_id"] for v in report["variants"])
    assert ids == ["sd15-tiny/onnxruntime/64x64", "sd15-tiny/onnxruntime/64x64/controlnet-canny"]
    for variant in report["variants"]:
        assert variant["reproducible"] is True
        assert {c["component"].split(".")[1] for c in variant["components"]} >= {"text_encoder", "unet", "vae_decoder"}
        for image in variant["images"]:
            assert image["psnr_db"] == "Infinity" or image["psnr_db"] > 40
            assert image["lpips"] is None and "LPIPS not computed" in image["lpips_reason"]
    html = _Collector()
    html.feed((out / "parity.html").read_text())
    assert html.tables >= 1 and html.rows >= 3
    assert html.images and all((out / src).is_file() for src in html.images)


def test_a_corrupted_engine_fails_parity_naming_the_component(tmp_path, built_sd15, capsys):
    path, workspace = _copy_config(tmp_path, built_sd15)
    unet_dir = next((workspace / "engines" / "onnxruntime").glob("sd15-tiny.unet.*"))
    model = onnx.load(str(unet_dir / "model.onnx"), load_external_data=False)
    target = next(t for t in model.graph.initializer if t.name.endswith("conv_in.weight"))
    info = {e.key: e.value for e in target.external_data}
    offset, length = int(info.get("offset", 0)), int(info["length"])
    with open(unet_dir / info["location"], "r+b") as f:
        f.seek(offset)
        f.write(np.random.default_rng(0).standard_normal(length // 4).astype(np.float32).tobytes())
    # re-sealed: a wrong engine whose manifest vouches for it (a bad build, not a tampered file, which find()
    # refuses by sha256 before parity sees it); parity is the gate that must catch it
    manifest = json.loads((unet_dir / "manifest.json").read_text())
    manifest["engine_sha256"] = onnx_sha256(unet_dir / "model.onnx")
    manifest["file_sha256"] = record_files(unet_dir)
    (unet_dir / "manifest.json").write_text(json.dumps(manifest))
    code = main(["parity", str(path), "--steps", "2", "--out", str(tmp_path / "report")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1
    assert "failed parity" in err and "failing engines: sd15-tiny.unet.64x64.b2.fp32" in err
    report = json.loads((tmp_path / "report" / "parity.json").read_text())
    assert report["passed"] is False
    assert {name for v in report["variants"] for name in v["failing_engines"]} == {"sd15-tiny.unet.64x64.b2.fp32"}


def test_prompts_file_and_seeds_choose_the_images(tmp_path, built_sd15):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# a comment line\na red barn in snow\n\n  a city at night  \n")
    out = tmp_path / "report"
    assert main(["parity", str(built_sd15), "--prompts", str(prompts), "--seeds", "3", "--seeds", "5",
                 "--steps", "2", "--out", str(out)]) == 0
    report = json.loads((out / "parity.json").read_text())
    assert len(report["variants"]) == 2
    for variant in report["variants"]:
        asked = [(image["prompt"], image["seed"]) for image in variant["images"]]
        assert asked == [("a red barn in snow", 3), ("a red barn in snow", 5), ("a city at night", 3),
                         ("a city at night", 5)]
        for image in variant["images"]:  # both images of every prompt x seed written, under distinct names
            assert all((out / image[key]).is_file() or list(out.rglob(image[key])) for key in
                       ("reference_png", "candidate_png"))
    names = [image[key] for v in report["variants"] for image in v["images"] for key in ("reference_png",
                                                                                       "candidate_png")]
    assert len(set(names)) == 2 * 2 * 4


@pytest.mark.parametrize("text,message", [("# only a comment\n\n", "no prompts"), (None, "cannot read")])
def test_a_prompts_file_without_prompts_is_refused(tmp_path, built_sd15, capsys, text, message):
    prompts = tmp_path / "prompts.txt"
    if text is not None:
        prompts.write_text(text)
    assert main(["parity", str(built_sd15), "--prompts", str(prompts), "--out", str(tmp_path / "r")]) == 1
    assert message in " ".join(capsys.readouterr().err.split())
