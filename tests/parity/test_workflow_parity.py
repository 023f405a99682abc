"""`parity` on a manifest declaring txt2img, img2img and inpaint: every workflow's images through the onnxruntime
and openvino engines within the parity gate of the torch reference, with the input and mask beside them."""

from __future__ import annotations

import json

import pytest

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import ParityOptions, run_parity


@pytest.fixture(scope="module")
def workflow_report(built_sd15_workflows, tmp_path_factory):
    out = tmp_path_factory.mktemp("workflow-parity")
    config = load_engines_file(built_sd15_workflows, check_sources=True)
    run = run_parity(config, out, ParityOptions(prompts=("a lighthouse at dusk",), seeds=(0, 1), compute_lpips=False))
    return run, out


def test_every_workflow_passes_on_both_targets(workflow_report):
    run, _ = workflow_report
    seen = {(v.target, v.workflow): v for v in run.report.variants}
    assert set(seen) == {(t, w) for t in ("onnxruntime", "openvino") for w in ("txt2img", "img2img", "inpaint")}
    for variant in seen.values():
        assert variant.passed, (variant.variant_id, variant.failure_reasons)
        assert variant.strength == (None if variant.workflow == "txt2img" else 0.6)
    assert run.report.passed
    ids = sorted(v.variant_id for v in run.report.variants)
    assert "sd15-tiny/onnxruntime/64x64" in ids and "sd15-tiny/onnxruntime/64x64/inpaint" in ids


def test_report_shows_input_mask_reference_and_engine(workflow_report):
    run, out = workflow_report
    data = json.loads((out / "parity.json").read_text())
    inpaint = next(v for v in data["variants"] if v["workflow"] == "inpaint")
    image = inpaint["images"][0]
    for name in (image["init_png"], image["mask_png"], image["reference_png"], image["candidate_png"]):
        assert (out / name).is_file(), name
    html = (out / "parity.html").read_text()
    for label in ("input", "mask", "reference", "candidate"):
        assert f"<figcaption>{label}</figcaption>" in html
    txt = next(v for v in data["variants"] if v["workflow"] == "txt2img")
    assert txt["images"][0]["init_png"] is None  # text-to-image shows no input


def test_the_workflow_images_differ_from_text_to_image(workflow_report):
    """The init image reached the engines: img2img's image is not txt2img's for the same prompt and seed."""
    import numpy as np
    from PIL import Image

    run, out = workflow_report
    by_workflow = {v.workflow: v for v in run.report.variants if v.target == "onnxruntime"}
    txt = np.asarray(Image.open(out / by_workflow["txt2img"].images[0].candidate_png))
    img = np.asarray(Image.open(out / by_workflow["img2img"].images[0].candidate_png))
    assert np.abs(txt.astype(int) - img.astype(int)).mean() > 5
