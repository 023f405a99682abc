"""The saved calibration state is read without running pickled code (issue 20, item 3)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from trt_diffusion.errors import QuantizeError
from trt_diffusion.families import Family
from trt_diffusion.quantize import ptq
from trt_diffusion.quantize.calibration import CalibrationRecipe, capture_calls, denoiser_of, load_pipeline
from trt_diffusion.quantize.exclusions import select_layers
from trt_diffusion.quantize.prompts import load_prompts, take

RECIPE = CalibrationRecipe(prompts=tuple(take(load_prompts(None)[0], 1)), steps=1, seed=0, algorithm="max",
                           width=64, height=64)


class _Payload:
    """Unpickling this calls Path.touch(marker): what a planted modelopt_state.pt could do with os.system."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_planted_pickle_does_not_run(tiny_model_factory, tmp_path):
    marker = tmp_path / "code-ran"
    state = tmp_path / "modelopt_state.pt"
    torch.save({"format": ptq.STATE_FORMAT, "modelopt_version": ptq.modelopt_version(), "x": _Payload(marker)},
               state)
    module = denoiser_of(load_pipeline(tiny_model_factory("sd15")))
    with pytest.raises(QuantizeError, match="unreadable calibration state"):
        ptq.restore_state(module, state)
    assert not marker.exists()


@pytest.mark.parametrize("precision,algorithm", [("int8", "max"), ("int8", "smoothquant"), ("int8", "percentile"),
                                                 ("fp8", "max")])
def test_a_saved_state_still_restores(tiny_model_factory, tmp_path, precision, algorithm):
    model_dir = tiny_model_factory("sd15")
    recipe = dataclasses.replace(RECIPE, algorithm=algorithm)
    pipe = load_pipeline(model_dir)
    module = denoiser_of(pipe)
    ptq.calibrate(module, precision, algorithm, select_layers(module),
                  ptq.replay(capture_calls(pipe, Family.sd15, recipe)))
    ptq.save_state(module, tmp_path / "state.pt")
    fresh = denoiser_of(load_pipeline(model_dir))
    ptq.restore_state(fresh, tmp_path / "state.pt")
    expected, restored = ptq.amax_tensors(module), ptq.amax_tensors(fresh)
    assert restored.keys() == expected.keys() and expected
    assert all(torch.equal(restored[n], expected[n]) for n in expected)
