"""Seeded calibration: the same recipe gives bit-equal scales; the saved state restores them exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trt_diffusion.families import Family
from trt_diffusion.quantize import ptq
from trt_diffusion.quantize.calibration import (
    CalibrationRecipe,
    calibration_loop,
    capture_calls,
    denoiser_of,
    load_pipeline,
)
from trt_diffusion.quantize.exclusions import select_layers
from trt_diffusion.quantize.prompts import load_prompts, take

RECIPE = CalibrationRecipe(prompts=tuple(take(load_prompts(None)[0], 2)), steps=2, seed=0, algorithm="max",
                           width=64, height=64)


def _calibrated(model_dir, recipe: CalibrationRecipe, precision: str = "int8"):
    pipe = load_pipeline(model_dir)
    module = denoiser_of(pipe)
    calls = capture_calls(pipe, Family.sd15, recipe)
    ptq.calibrate(module, precision, recipe.algorithm, select_layers(module), ptq.replay(calls))
    return module, calls


def test_same_recipe_gives_bit_equal_scales_and_another_seed_does_not(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("sd15")
    first, calls = _calibrated(model_dir, RECIPE)
    assert len(calls) == RECIPE.samples * RECIPE.steps  # one call per prompt and step
    args, kwargs = calls[0]
    assert args[0].shape == (2, 4, 8, 8)  # CFG doubles the batch; 64 px -> 8 latent px
    assert kwargs["encoder_hidden_states"].shape == (2, 77, 32)

    second, _ = _calibrated(model_dir, RECIPE)
    first_amax, second_amax = ptq.amax_tensors(first), ptq.amax_tensors(second)
    assert first_amax.keys() == second_amax.keys() and first_amax
    for name in first_amax:
        assert torch.equal(first_amax[name], second_amax[name]), name

    reseeded, _ = _calibrated(model_dir, dataclasses.replace(RECIPE, seed=7))
    changed = [n for n, t in ptq.amax_tensors(reseeded).items() if not torch.equal(t, first_amax[n])]
    assert any(n.endswith("input_quantizer") for n in changed)  # activations moved; weights cannot

    # the saved state puts the same ranges on a fresh module (no recalibration)
    ptq.save_state(first, tmp_path / "state.pt")
    fresh = denoiser_of(load_pipeline(model_dir))
    ptq.restore_state(fresh, tmp_path / "state.pt")
    restored = ptq.amax_tensors(fresh)
    assert restored.keys() == first_amax.keys()
    assert all(torch.equal(restored[n], first_amax[n]) for n in first_amax)


def test_calibrating_during_the_generations_gives_the_replayed_scales(tiny_model_factory):
    """The stage takes ModelOpt's statistics while the recipe generates (each denoiser call runs once, not
    recorded and replayed): calibrating quantizers pass values through, so the data and scales are the same."""
    model_dir = tiny_model_factory("sd15")
    replayed, calls = _calibrated(model_dir, RECIPE)

    pipe = load_pipeline(model_dir)
    module = denoiser_of(pipe)
    forward_loop, recorded = calibration_loop(pipe, Family.sd15, RECIPE)
    ptq.calibrate(module, "int8", RECIPE.algorithm, select_layers(module), forward_loop)
    assert recorded.seen == len(calls) and len(recorded.calls) == 1  # only the export's example is kept
    assert all(torch.equal(a, b) for a, b in zip(recorded.calls[0][0], calls[0][0]))
    during, after = ptq.amax_tensors(module), ptq.amax_tensors(replayed)
    assert during.keys() == after.keys() and during
    assert all(torch.equal(during[n], after[n]) for n in during)

    with pytest.raises(RuntimeError, match="pipeline's own denoiser"):
        forward_loop(denoiser_of(load_pipeline(model_dir)))


@pytest.mark.parametrize("algorithm", ["smoothquant", "percentile"])
def test_other_algorithms_calibrate(tiny_model_factory, algorithm):
    module, calls = _calibrated(tiny_model_factory("sd15"), dataclasses.replace(RECIPE, algorithm=algorithm))
    ptq.check_calibrated(module)
    assert ptq.quantized_layers(module)
    if algorithm == "smoothquant":  # SmoothQuant folds per-channel scales into the Linear inputs
        layer = module.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
        assert layer.input_quantizer.pre_quant_scale is not None
    with torch.no_grad():
        out = module(*calls[0][0], **calls[0][1])[0]
    assert torch.isfinite(out).all()


def test_a_unet_with_controlnets_is_calibrated_with_their_residuals(tiny_model_factory):
    """A UNet whose engines take ControlNet residuals: the odd prompts run through diffusers' ControlNet pipeline over
    the same UNet, so its calls carry the residuals (mapped onto the engine's residual inputs, not zeros) and the
    ranges after each addition see them: an up block's input range grows past the one calibrated without them."""
    from trt_diffusion.components import MID_RESIDUAL, down_residual_name
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.quantize.feeds import denoiser_interface

    model_dir = tiny_model_factory("sd15", controlnet=True)
    recipe = dataclasses.replace(RECIPE, controlnets=(str(model_dir / "controlnet"),))
    assert [recipe.controlnet_of(i) for i in range(4)] == [None, 0, None, 0]
    assert recipe.digest != RECIPE.digest and "controlnets" not in RECIPE.to_json()

    plain, plain_calls = _calibrated(model_dir, RECIPE)
    with_control, calls = _calibrated(model_dir, recipe)
    assert len(calls) == recipe.samples * recipe.steps
    assert all("down_block_additional_residuals" not in kwargs for _, kwargs in calls[:recipe.steps])
    controlled = calls[recipe.steps][1]  # prompt 1's first call: through the ControlNet
    assert controlled["mid_block_additional_residual"].abs().max() > 0

    config = load_engines_file(_engines_yaml(model_dir))
    interface = denoiser_interface(config.models["sd15-tiny"], "unet")
    feeds = interface.feeds(calls[recipe.steps])
    assert torch.equal(feeds[MID_RESIDUAL], controlled["mid_block_additional_residual"])
    assert torch.equal(feeds[down_residual_name(0)], controlled["down_block_additional_residuals"][0])
    assert not interface.feeds(plain_calls[0])[MID_RESIDUAL].any()  # a plain call: zeros, as before

    before, after = ptq.amax_tensors(plain), ptq.amax_tensors(with_control)
    grown = [n for n in before if n.startswith("up_blocks") and n.endswith("input_quantizer")
             and after[n].max() > before[n].max()]
    assert grown, "no up-block input range saw the ControlNet's residuals"


def _engines_yaml(model_dir):
    import yaml

    path = model_dir.parent / f"{model_dir.name}-engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": {"sd15-tiny": {
        "source": str(model_dir), "family": "sd15", "buckets": ["64x64"], "targets": ["onnxruntime"],
        "controlnets": {"canny": {"source": str(model_dir / "controlnet")}}}}}))
    return path
