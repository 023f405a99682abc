"""Z-Image's transformer quantized to int8 and fp8 (issue #42, acceptance 4) through the generic quantize stage: its
pipeline's list-passing calls read by the declaration's `quantize_calls` (components/z_image.py `ZImageCalls`), the
Q/DQ graph traced over the padded-tensor computation; the gate passes on the tiny model, and the graph runs at a
batch, size and text length other than the calibration's, near the fp32 module there. Slow: a calibration, a trace
and a gate per precision, at 32x32 (a 2x2 patch grid of the tiny model) to keep them short.
ModelOpt calibrates per precision (the stage keys a calibration by it), so int8 and fp8 calibrate once each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from trt_diffusion.components import Geometry, get_component, load_model_config
from trt_diffusion.engines_file import Size, load_engines_file
from trt_diffusion.families import Component
from trt_diffusion.models.loading import load_component

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("z_image")


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_quantized_transformer_passes_the_gate_and_runs_at_other_shapes(folder, tmp_path, precision):
    import onnxruntime as ort

    from trt_diffusion.quantize.stage import quantize_component

    config = tmp_path / "engines.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": {"m": {
        "source": str(folder), "family": "z_image", "components": ["transformer"],
        "precision": {"transformer": precision}, "buckets": ["32x32"],
        "quantization": {"calibration": {"samples": 2, "steps": 2, "seed": 0}}}}}))
    artifact = quantize_component(load_engines_file(config).models["m"], "transformer", precision, None,
                                  tmp_path / "build", held_out_samples=1)
    gate = artifact.manifest["gate"]
    assert gate["passed"], gate["failures"]
    assert artifact.manifest["graph"]["quantize_linear"] > 0 and not artifact.manifest["static_shapes"]

    # another batch, a non-square size and one text length of its own: the legacy trace kept the axes dynamic
    definition = get_component("z_image", "transformer")
    model_config = load_model_config(folder, "z_image", "transformer")
    feeds = definition.dummy_inputs(model_config, {}, Geometry(3, Size(96, 64), text=45))
    session = ort.InferenceSession(str(artifact.path / artifact.manifest["onnx"]), providers=["CPUExecutionProvider"])
    (got,) = session.run(["noise_pred"], feeds)
    wrapper = definition.wrapper(load_component(folder, Component.transformer), model_config, {})
    with torch.inference_mode():
        expected = wrapper(*[torch.from_numpy(feeds[n]) for n in definition.io(model_config, {}).input_names]).numpy()
    assert got.shape == expected.shape == (3, 16, 8, 12)
    peak = np.abs(expected).max()
    psnr = 20 * np.log10(2 * peak / np.sqrt(np.mean((got - expected) ** 2)))
    assert psnr > 20, psnr  # the gate's output bars: 22 dB int8, 20 dB fp8 (seen on the calls: 52 / 45 dB)
