"""A step cache on an int8/fp8 denoiser (docs/step-cache.md#quantized-denoisers): engines.yaml accepts it, each piece
is a quantized variant of its own whose key sees the piece and the cut, while the calibration stays the denoiser's
(adding a cache changes neither its key nor the uncached denoiser's); a cached quantized variant's parity bar is the
looser of the cache's and the precision's. No model is run.

Before the change: engines.yaml refused the cache ("step caching with an int8 unet is not supported yet") and
plan_variant took no piece."""

from __future__ import annotations

import pytest

from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.errors import QuantizeError
from trt_diffusion.metrics import thresholds_for
from trt_diffusion.parity.stage import step_cache_thresholds
from trt_diffusion.quantize.stage import plan_variant
from trt_diffusion.step_cache import StepCache, StepCacheMethod

from .conftest import model_entry, resolved

DEEPCACHE = {"method": "deepcache", "interval": 3, "branch": 0}


@pytest.fixture
def model_of(tiny_model_factory, write_config):
    sd15 = tiny_model_factory("sd15")

    def model(precision: str = "int8", name: str = "engines.yaml", **extra):
        return resolved(write_config({"m": model_entry(sd15, "sd15", precision, **extra)}, name), "m")

    model.config = lambda precision="int8", **extra: write_config(
        {"m": model_entry(sd15, "sd15", precision, **extra)}, "matrix.yaml")

    return model


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_step_cache_on_a_quantized_unet_is_accepted_with_quantized_pieces(model_of, precision):
    model = model_of(precision, step_cache=DEEPCACHE)
    assert model.step_cache.method is StepCacheMethod.deepcache
    plans = {piece: plan_variant(model, "unet", precision, None, piece=piece)
             for piece in (None, "unet_deep", "unet_shallow")}
    assert {p.name for p in plans.values()} == {f"m.unet.{precision}", f"m.unet_deep.{precision}",
                                                f"m.unet_shallow.{precision}"}
    # one calibration: the pieces restore the denoiser's (same name, same key)
    assert {p.calibration_name for p in plans.values()} == {f"m.unet.{precision}"}
    assert len({p.calibration_hash for p in plans.values()}) == 1
    assert len({p.input_hash for p in plans.values()}) == 3  # three graphs, three artifacts


def test_adding_a_cache_changes_neither_the_calibration_nor_the_unet_key(model_of):
    plain = plan_variant(model_of(), "unet", "int8", None)
    cached = model_of(name="cached.yaml", step_cache=DEEPCACHE)
    assert plan_variant(cached, "unet", "int8", None).input_hash == plain.input_hash
    assert plan_variant(cached, "unet", "int8", None, piece="unet_deep").calibration_hash == plain.calibration_hash


def test_the_cut_and_the_calibration_change_the_pieces_keys(model_of):
    base = model_of(step_cache=DEEPCACHE)
    deeper = model_of(name="deeper.yaml", step_cache={**DEEPCACHE, "branch": 1})
    later = model_of(name="interval.yaml", step_cache={**DEEPCACHE, "interval": 2})
    recalibrated = model_of(name="seed.yaml", step_cache=DEEPCACHE, calibration={"seed": 7})
    for piece in ("unet_deep", "unet_shallow"):
        key = plan_variant(base, "unet", "int8", None, piece=piece).input_hash
        # branch: another cut, another graph; the interval is a run-time schedule (no new graph)
        assert plan_variant(deeper, "unet", "int8", None, piece=piece).input_hash != key
        assert plan_variant(later, "unet", "int8", None, piece=piece).input_hash == key
        assert plan_variant(recalibrated, "unet", "int8", None, piece=piece).input_hash != key
    assert (plan_variant(deeper, "unet", "int8", None, piece="unet_deep").calibration_hash
            == plan_variant(base, "unet", "int8", None).calibration_hash)


def test_a_piece_the_model_has_not_is_a_clear_error(model_of):
    with pytest.raises(QuantizeError, match="no step-cache piece 'unet_deep'.*no step_cache"):
        plan_variant(model_of(), "unet", "int8", None, piece="unet_deep")
    with pytest.raises(QuantizeError, match="no step-cache piece 'first_block'.*unet_deep, unet_shallow"):
        plan_variant(model_of(step_cache=DEEPCACHE), "unet", "int8", None, piece="first_block")


def test_the_engine_matrix_builds_every_piece_in_int8(model_of):
    specs = [s for s in expand(load_engines_file(model_of.config(step_cache=DEEPCACHE))) if s.component == "unet"]
    assert {(s.piece or "unet", s.precision.value) for s in specs} == {
        ("unet", "int8"), ("unet_deep", "int8"), ("unet_shallow", "int8")}


@pytest.mark.parametrize("precision,cache,expected", [
    ("int8", StepCache(StepCacheMethod.deepcache), (20.0, 0.80)),  # int8's 20 dB under the cache's 24 dB
    ("fp8", StepCache(StepCacheMethod.first_block), (20.0, 0.80)),  # the cache's 30 dB / 0.90 loosened by fp8's bar
    ("int8", StepCache(StepCacheMethod.deepcache, min_psnr_db=18.0, min_ssim=0.85), (18.0, 0.80)),
])
def test_a_cached_quantized_variant_is_judged_by_the_looser_bar(precision, cache, expected):
    bar = step_cache_thresholds(cache, thresholds_for(precision))
    assert (bar.min_psnr_db, bar.min_ssim) == expected
    # an engines.yaml `parity:` override of the precision's bar is taken into account
    looser = step_cache_thresholds(cache, thresholds_for(precision, {"min_psnr_db": 12.0}))
    assert looser.min_psnr_db == 12.0


def test_a_cached_unquantized_variant_keeps_the_cache_gate():
    bar = step_cache_thresholds(StepCache(StepCacheMethod.deepcache))
    assert (bar.min_psnr_db, bar.min_ssim) == (24.0, 0.80)
