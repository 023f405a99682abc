"""The quality gate fails a broken quantization with the numbers, and nothing is committed."""

from __future__ import annotations

import math

import pytest
import torch

from trt_diffusion.errors import QuantizeError
from trt_diffusion.quantize import ptq
from trt_diffusion.quantize.gate import GateResult, GateThresholds, gate_failures
from trt_diffusion.quantize.stage import ARTIFACT_KIND, quantize_component
from trt_diffusion.workspace.store import ArtifactStore

from .conftest import model_entry, resolved


@pytest.mark.parametrize("precision,factor", [("int8", 1e4), pytest.param("fp8", 1e-3, marks=pytest.mark.slow)])
def test_absurd_activation_ranges_fail_the_gate(tiny_model_factory, write_config, tmp_path, monkeypatch,
                                                precision, factor):
    real_calibrate = ptq.calibrate

    def broken_calibrate(module, *args, **kwargs):
        real_calibrate(module, *args, **kwargs)
        with torch.no_grad():  # int8: everything rounds to zero; fp8: everything saturates
            for name, quantizer in module.named_modules():
                if name.endswith("input_quantizer") and quantizer.is_enabled:
                    quantizer.amax = quantizer.amax * factor
        return module

    monkeypatch.setattr(ptq, "calibrate", broken_calibrate)
    path = write_config({"m": model_entry(tiny_model_factory("sd15"), "sd15", precision)})
    workspace = tmp_path / "build"
    with pytest.raises(QuantizeError, match="quality gate failed") as caught:
        quantize_component(resolved(path, "m"), "unet", precision, None, workspace, held_out_samples=1)
    message = str(caught.value)
    assert "PSNR" in message and "dB" in message and "measured:" in message
    assert not list((workspace / ARTIFACT_KIND).glob("m.*"))  # nothing committed, no temp folder left
    assert ArtifactStore(workspace).clean_stale() == []


def _result(**changes) -> GateResult:
    values = dict(precision="int8", thresholds={}, calls=2, output_psnr_db_min=40.0, output_psnr_db_mean=41.0,
                  output_max_abs=0.1, output_nonfinite=0,
                  images=[{"psnr_db": 35.0, "ssim": 0.99, "lpips": None, "lpips_reason": "no weights",
                           "nonfinite": False}])
    values.update(changes)
    return GateResult(**values)


def test_gate_rules():
    thresholds = GateThresholds.for_precision("int8")
    assert gate_failures(_result(), thresholds) == []
    assert "NaN/Inf" in gate_failures(_result(output_nonfinite=3, output_psnr_db_min=math.nan), thresholds)[0]
    low = gate_failures(_result(output_psnr_db_min=10.0), thresholds)
    assert low and "10.00 dB < 22 dB" in low[0]
    image = gate_failures(_result(images=[{"psnr_db": 12.0, "ssim": 0.5, "lpips": None, "lpips_reason": "x",
                                       "nonfinite": False}]), thresholds)
    assert any("PSNR 12.00 dB" in f for f in image) and any("SSIM" in f for f in image)
    # engines.yaml `parity:` tightens the image bar
    strict = GateThresholds.for_precision("int8", {"min_psnr_db": 36.0, "min_ssim": None})
    assert strict.image.min_psnr_db == 36.0 and strict.image.min_ssim == thresholds.image.min_ssim
    assert any("PSNR 35.00 dB < 36 dB" in f for f in gate_failures(_result(), strict))
