"""Quantization reports live progress: its four steps, the calibration prompts, the gate."""

from __future__ import annotations

import logging

import pytest
import yaml

from trt_diffusion import progress
from trt_diffusion.quantize.stage import quantize_component

from .conftest import DENOISER, model_entry, resolved


@pytest.mark.slow  # a whole quantization (about 11 s); progress lines keep their unit tests in tests/test_progress.py
def test_quantize_reports_each_step_as_a_progress_line(tiny_model_factory, tmp_path, caplog):
    config = tmp_path / "engines.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": {
        "m": model_entry(tiny_model_factory("sd15"), "sd15", "int8")}}))
    with caplog.at_level(logging.INFO, logger=progress.LOGGER_NAME):
        quantize_component(resolved(config, "m"), DENOISER["sd15"], "int8", None, tmp_path / "build",
                           held_out_samples=1)
    lines = [record.getMessage().split("] ", 1)[1] for record in caplog.records
             if record.name == progress.LOGGER_NAME]
    name = "m.unet.int8"
    for position, what in ((1, "load the pipeline"), (3, "Q/DQ ONNX export"), (4, "quality gate")):
        assert any(line.startswith(f"quantize {position}/4 {name}: {what}") for line in lines), lines
        assert any(line.startswith(f"quantize {position}/4 {name}: done in ") for line in lines), lines
    # TINY_CALIBRATION: 2 samples x 2 steps, ModelOpt's statistics taken as each prompt generates
    assert "calibration 2/2: seed 1, 2 steps at 64x64" in lines
    assert any(line.startswith(f"quantize 2/4 {name}: calibration (the recipe's generations") for line in lines)
    assert any(line.startswith("gate: Q/DQ ONNX 1/1: ") for line in lines), lines
