"""Each check, in process over the built tiny engines, passes as built and fails when what it checks is broken
(acceptance 2). The breakage goes in through the check's inputs (runners, engines.yaml, the LoRA file, the
baseline) or a monkeypatch here, never through library code. The overload check's breakage needs a server
(test_served.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.preflight import connect
from trt_diffusion.preflight.checks import get_check
from trt_diffusion.preflight.checks.base import CheckContext
from trt_diffusion.preflight.run import run_check

pytestmark = pytest.mark.timeout(300)


def context(path, *, table=None, honour_deadline=True, baseline=None, save_baseline=False) -> CheckContext:
    config = load_engines_file(path)
    (model,) = config.models
    engines = connect.find_engines(config, model, "onnxruntime")
    deployment = connect.in_process(config, engines, table=table, honour_deadline=honour_deadline)
    return CheckContext(config, model, "onnxruntime", config.preflight, deployment, engines, baseline=baseline,
                        save_baseline=save_baseline)


@pytest.fixture(scope="module")
def config_path(preflight_yaml):
    return preflight_yaml()


class _Wrapped:
    def __init__(self, runner, change):
        self.runner, self.change, self.inputs = runner, change, runner.inputs

    def run(self, feeds):
        outputs = self.runner.run(feeds)
        return {k: self.change(v) if k == "noise_pred" else v for k, v in outputs.items()}


def table_with(path, change):
    """The built engines' runners with the UNet's noise prediction passed through `change`."""
    from trt_diffusion.runtime.loader import runner_for, table_from_engines

    config = load_engines_file(path)
    engines = connect.servable(connect.find_engines(config, "sd15-tiny", "onnxruntime"))

    def make(engine):
        runner = runner_for(engine)
        return _Wrapped(runner, change) if engine.spec.component == "unet" else runner

    return table_from_engines(engines, make)


def test_reproducibility_passes_and_fails_with_a_non_deterministic_engine(config_path):
    assert run_check("reproducibility", context(config_path)).status == "pass"
    rng = np.random.default_rng()
    noisy = table_with(config_path, lambda v: v + rng.normal(0, 0.05, v.shape).astype(v.dtype))
    result = run_check("reproducibility", context(config_path, table=noisy))
    assert result.status == "fail" and "the same request twice gave different images" in result.failures[0]
    assert "no batch-2 engines" in result.notes[0]  # batch [1]: the batch-of-2 half is n/a, with why


def test_buckets_fails_for_a_bucket_with_no_engine(config_path, preflight_yaml):
    result = run_check("buckets", context(config_path))
    assert result.status == "pass" and result.rows[0]["first_request_s"] > 0
    unbuilt = preflight_yaml(model_changes={"buckets": ["64x64", "96x96"]})
    result = run_check("buckets", context(unbuilt))
    assert result.status == "fail"
    assert any("bucket 96x96: 3 engine(s) not built" in f for f in result.failures), result.failures
    assert [r["engines_built"] for r in result.rows] == [True, False]


def test_memory_fails_under_a_budget_below_the_real_peak(config_path, preflight_yaml):
    result = run_check("memory", context(config_path))
    assert result.status == "pass" and result.figures["cpu_peak_gb"] > 0.05
    assert result.figures["controlnet"] == "canny"
    tight = preflight_yaml({"memory": {"max_rss_gb": 0.01}})
    result = run_check("memory", context(tight))
    assert result.status == "fail" and "> budget 0.01 GB" in result.failures[0]


def test_isolation_fails_when_requests_share_a_scheduler(config_path, monkeypatch):
    assert run_check("isolation", context(config_path)).status == "pass"
    from trt_diffusion.runtime import schedulers, unet_loop

    shared = {}

    def one_scheduler_per_name(name, config, family):  # the bug: state shared between requests
        if name not in shared:
            shared[name] = schedulers.make_scheduler(name, config, family)
        return shared[name]

    monkeypatch.setattr(unet_loop, "make_scheduler", one_scheduler_per_name)  # the sd15 loop's
    result = run_check("isolation", context(config_path))
    assert result.status == "fail"
    assert all("differs from its one-at-a-time image" in f or "failed when run concurrently" in f
               for f in result.failures), result.failures


def test_cancellation_fails_when_the_loop_ignores_it(config_path):
    result = run_check("cancellation", context(config_path))
    assert result.status == "pass", result.failures
    assert result.figures["denoiser_calls_after_deadline"] < result.figures["denoiser_calls_if_not_cancelled"]
    result = run_check("cancellation", context(config_path, honour_deadline=False))
    assert result.status == "fail" and any("the loop ignored cancellation" in f for f in result.failures)


def test_plugins_fail_for_a_lora_that_changes_nothing(config_path, preflight_yaml, tmp_path):
    from safetensors.numpy import load_file, save_file

    result = run_check("plugins", context(config_path))
    assert result.status == "pass", result.failures
    assert {r["plugin"] for r in result.rows} == {"ControlNet canny", "LoRA style"}
    config = load_engines_file(config_path)
    lora = config.models["sd15-tiny"].loras["style"]
    weights = load_file(lora.path)
    zero = {k: np.zeros_like(v) if "lora_B" in k or "lora_up" in k else v for k, v in weights.items()}
    assert any(not np.array_equal(zero[k], weights[k]) for k in weights)
    save_file(zero, tmp_path / "nothing.safetensors")
    broken = preflight_yaml(model_changes={"loras": {"style": {"source": str(tmp_path / "nothing.safetensors"),
                                                               "mode": "refit"}}})
    result = run_check("plugins", context(broken))
    assert result.status == "fail"
    assert all("LoRA style" in f and "changed nothing visible" in f for f in result.failures), result.failures


def test_quality_fails_on_a_drop_against_the_baseline(config_path):
    from trt_diffusion.preflight.baseline import load_baseline, save_baseline

    saving = context(config_path, save_baseline=True)
    assert run_check("quality", saving).status == "n/a"
    folder = save_baseline(saving.saved["baseline"])
    config = load_engines_file(config_path)
    baseline = load_baseline(folder, model="sd15-tiny", engine_keys=saving.deployment.engine_keys,
                             quality=config.preflight.quality, size="64x64", config_path=config_path)
    result = run_check("quality", context(config_path, baseline=baseline))
    assert result.status == "pass" and result.figures["min_psnr_db"] == float("inf")
    drifted = table_with(config_path, lambda v: v * 4.0)  # a denoiser gone wrong (a broken quantization)
    result = run_check("quality", context(config_path, table=drifted, baseline=baseline))
    assert result.status == "fail" and "PSNR" in result.failures[0], result.figures


def test_a_check_that_overruns_its_timeout_fails_and_says_so(config_path, preflight_yaml):
    slow = context(preflight_yaml({"isolation": {"timeout_s": 0.05}}))
    result = run_check("isolation", slow)
    assert result.status == "fail" and "did not finish within its timeout of 0.05 s" in result.failures[0]


def test_every_check_has_a_module():
    from trt_diffusion.checklist import CHECK_NAMES

    assert [get_check(n).name for n in CHECK_NAMES] == list(CHECK_NAMES)
    assert shutil.which  # noqa: B018 - keep the import used
