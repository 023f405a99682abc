"""engines.yaml's `step_cache:`: what it resolves to, the engines `plan` adds for it, and every wrong value as one
file:line message (exit 1, no traceback)."""

from __future__ import annotations

import textwrap

import pytest

from trt_diffusion.cli import main
from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.step_cache import DEFAULT_GATES, StepCacheMethod, deepcache_full_steps, schedule_label


def write(tmp_path, body: str, source) -> object:
    path = tmp_path / "engines.yaml"
    path.write_text(textwrap.dedent(body).replace("{source}", str(source)))
    return path


SD15 = """\
version: 1
models:
  m:
    source: {source}
    family: sd15
    buckets: ['64x64']
    targets: [onnxruntime]
"""
FLUX = SD15.replace("family: sd15", "family: flux")


def test_deepcache_defaults_and_its_two_extra_engines(tmp_path, tiny_sd15_dir, capsys):
    path = write(tmp_path, SD15 + "    step_cache: {method: deepcache}\n", tiny_sd15_dir)
    model = load_engines_file(path).models["m"]
    cache = model.step_cache
    assert (cache.method, cache.interval, cache.branch, cache.enabled) == (StepCacheMethod.deepcache, 3, 0, True)
    assert cache.gate == DEFAULT_GATES[StepCacheMethod.deepcache] == (24.0, 0.80)
    unet = [s for s in expand(load_engines_file(path)) if s.component == "unet"]
    assert sorted(s.piece or "unet" for s in unet) == ["unet", "unet_deep", "unet_shallow"]
    assert len({s.key for s in unet}) == 3 and len({s.name for s in unet}) == 3
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unet_deep" in out and "unet_shallow" in out


def test_the_uncached_engine_keeps_its_key_and_the_branch_moves_only_the_pieces(tmp_path, tiny_sd15_dir):
    def unet_keys(extra: str) -> dict:
        return {s.piece: s.key for s in expand(load_engines_file(write(tmp_path, SD15 + extra, tiny_sd15_dir)))
                if s.component == "unet"}

    plain = unet_keys("")
    cached = unet_keys("    step_cache: {method: deepcache, interval: 2, branch: 0}\n")
    other_interval = unet_keys("    step_cache: {method: deepcache, interval: 5, branch: 0}\n")
    other_branch = unet_keys("    step_cache: {method: deepcache, interval: 2, branch: 1}\n")
    assert cached[None] == plain[None] == other_branch[None]  # adding a cache rebuilds nothing that ran before
    assert cached == other_interval  # the interval is a run-time schedule, not a graph
    assert cached["unet_deep"] != other_branch["unet_deep"] and cached["unet_shallow"] != other_branch["unet_shallow"]


def test_first_block_on_flux(tmp_path, tiny_model_factory):
    path = write(tmp_path, FLUX + "    step_cache: {method: first_block, threshold: 0.1, gate: {min_psnr_db: 28}}\n",
                 tiny_model_factory("flux"))
    cache = load_engines_file(path).models["m"].step_cache
    assert (cache.method, cache.threshold, cache.gate) == (StepCacheMethod.first_block, 0.1, (28.0, 0.90))
    pieces = sorted(s.piece or "transformer" for s in expand(load_engines_file(path)) if s.component == "transformer")
    assert pieces == ["first_block", "rest_blocks", "transformer"]


CASES = [
    # (id, family, step_cache line, line, fragments)
    ("deepcache-on-a-dit", "flux", "    step_cache: {method: deepcache}\n", 8,
     ["models.m.step_cache.method", "deepcache is for the sd15, sdxl families, not flux", "use first_block"]),
    ("first-block-on-a-unet", "sd15", "    step_cache: {method: first_block}\n", 8,
     ["models.m.step_cache.method", "first_block is for the flux families, not sd15", "use deepcache"]),
    ("interval-one", "sd15", "    step_cache:\n      method: deepcache\n      interval: 1\n", 10,
     ["models.m.step_cache.interval", "interval 1 caches nothing", "N >= 2"]),
    ("branch-negative", "sd15", "    step_cache:\n      method: deepcache\n      branch: -1\n", 10,
     ["models.m.step_cache.branch", "negative"]),
    ("branch-past-the-unet", "sd15", "    step_cache:\n      method: deepcache\n      branch: 4\n", 10,
     ["models.m.step_cache.branch", "branch 4 is past this UNet's 4 skip levels (0..3)"]),
    ("threshold-zero", "flux", "    step_cache:\n      method: first_block\n      threshold: 0\n", 10,
     ["models.m.step_cache.threshold", "must be more than 0"]),
    ("threshold-negative", "flux", "    step_cache:\n      method: first_block\n      threshold: -0.1\n", 10,
     ["models.m.step_cache.threshold", "-0.1 must be more than 0"]),
    ("threshold-on-deepcache", "sd15", "    step_cache:\n      method: deepcache\n      threshold: 0.1\n", 10,
     ["models.m.step_cache.threshold", "not a setting of deepcache"]),
    ("interval-on-first-block", "flux", "    step_cache:\n      method: first_block\n      interval: 3\n", 10,
     ["models.m.step_cache.interval", "not a setting of first_block"]),
    ("unknown-key", "sd15", "    step_cache:\n      method: deepcache\n      intervall: 3\n", 10,
     ["models.m.step_cache.intervall", "unknown key", "did you mean 'interval'"]),
    ("unknown-method", "sd15", "    step_cache:\n      method: teacache\n", 9,
     ["models.m.step_cache.method", "'teacache' is not one of"]),
    ("gate-ssim-out-of-range", "sd15", "    step_cache:\n      method: deepcache\n      gate: {min_ssim: 2}\n", 10,
     ["models.m.step_cache.gate.min_ssim", "less than or equal to 1"]),
]


@pytest.mark.parametrize("case_id,family,extra,line,fragments", CASES, ids=[c[0] for c in CASES])
def test_a_wrong_step_cache_is_one_clear_error(tmp_path, capsys, tiny_model_factory, tiny_sd15_dir, case_id, family,
                                                 extra, line, fragments):
    base, source = (SD15, tiny_sd15_dir) if family == "sd15" else (FLUX, tiny_model_factory("flux"))
    path = write(tmp_path, base + extra, source)
    code = main(["plan", str(path)])
    captured = capsys.readouterr()
    assert code == 1, captured.out
    assert "Traceback" not in captured.err + captured.out
    message = " ".join(captured.err.split())
    assert f"{path}:{line}:" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_a_defaults_block_applies_where_the_method_fits(tmp_path, tiny_sd15_dir, tiny_model_factory):
    body = (f"version: 1\ndefaults:\n  targets: [onnxruntime]\n  buckets: ['64x64']\n"
            f"  step_cache: {{method: deepcache, interval: 2}}\nmodels:\n"
            f"  a: {{source: {tiny_sd15_dir}, family: sd15}}\n  b: {{source: {tiny_model_factory('flux')}, family: flux}}\n")
    config = load_engines_file(write(tmp_path, body, tiny_sd15_dir))
    assert config.models["a"].step_cache.interval == 2
    assert config.models["b"].step_cache is None


def test_deepcache_schedule():
    assert schedule_label(deepcache_full_steps(7, 3)) == "FccFccF"
    assert schedule_label(deepcache_full_steps(4, 2)) == "FcFc"
