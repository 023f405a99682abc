"""Preflight over a model declaring txt2img, img2img and inpaint: reproducibility, isolation and the plugin check
run per workflow (in process over the built onnxruntime engines), and isolation still catches shared state."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.preflight import connect
from trt_diffusion.preflight.checks.base import CheckContext
from trt_diffusion.preflight.run import run_check

from .conftest import FAST

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def workflows_yaml(built_sd15_workflows, tmp_path_factory) -> Path:
    document = yaml.safe_load(Path(built_sd15_workflows).read_text())
    document["build"]["workspace"] = str((Path(built_sd15_workflows).parent / document["build"]["workspace"]).resolve())
    document["preflight"] = FAST
    path = tmp_path_factory.mktemp("preflight-workflows") / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def context(path) -> CheckContext:
    config = load_engines_file(path)
    (model,) = config.models
    engines = connect.find_engines(config, model, "onnxruntime")
    deployment = connect.in_process(config, engines)
    return CheckContext(config, model, "onnxruntime", config.preflight, deployment, engines)


def test_reproducibility_runs_every_workflow(workflows_yaml):
    result = run_check("reproducibility", context(workflows_yaml))
    assert result.status == "pass", result.failures
    assert {r["workflow"] for r in result.rows} == {"txt2img", "img2img", "inpaint"}
    assert "× 3 workflows" in result.summary


def test_isolation_mixes_workflows_and_catches_shared_state(workflows_yaml, monkeypatch):
    result = run_check("isolation", context(workflows_yaml))
    assert result.status == "pass", result.failures
    assert {r["workflow"] for r in result.rows} == {"txt2img", "img2img", "inpaint"}
    from trt_diffusion.runtime import schedulers, unet_loop

    shared = {}

    def one_scheduler_per_name(name, config, family):  # the bug: state shared between requests
        return shared.setdefault(name, schedulers.make_scheduler(name, config, family))

    monkeypatch.setattr(unet_loop, "make_scheduler", one_scheduler_per_name)  # the sd15 loop's
    result = run_check("isolation", context(workflows_yaml))
    assert result.status == "fail"
    assert any("(img2img)" in f or "(inpaint)" in f for f in result.failures), result.failures


def test_the_refit_lora_is_checked_with_every_workflow(workflows_yaml):
    result = run_check("plugins", context(workflows_yaml))
    assert result.status == "pass", result.failures
    where = [r["where"] for r in result.rows]
    for target in ("onnxruntime", "openvino"):
        assert any(w.startswith(target) and w.endswith("(inpaint)") for w in where), where
        assert any(w.startswith(target) and w.endswith("(img2img)") for w in where), where


def test_quality_per_workflow_shows_input_mask_baseline_and_image(workflows_yaml, tmp_path):
    """A baseline saved for every declared workflow, then compared; the HTML shows the images side by side."""
    from trt_diffusion.preflight.run import run_preflight

    config = load_engines_file(workflows_yaml)
    saved = run_preflight(config, only=["quality"], save_baseline=True, in_process=True, target="onnxruntime",
                          out_dir=tmp_path / "first")
    assert saved.baseline is not None
    run = run_preflight(config, only=["quality"], in_process=True, target="onnxruntime", out_dir=tmp_path / "report")
    (check,) = run.report.checks
    assert check.status == "pass", check.failures
    rows = {row["workflow"]: row for row in check.rows}
    assert set(rows) == {"txt2img", "img2img", "inpaint"}
    assert {"input", "mask", "baseline", "image"} <= set(rows["inpaint"]) and "input" not in rows["txt2img"]
    html = (tmp_path / "report" / "preflight.html").read_text()
    for name in (rows["inpaint"][c] for c in ("input", "mask", "baseline", "image")):
        assert (tmp_path / "report" / name).is_file() and f'src="{name}"' in html
