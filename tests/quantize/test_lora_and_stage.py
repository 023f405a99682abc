"""The stage over engines.yaml: fused-LoRA variants, ControlNet residual inputs, reuse of the calibration."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml

from trt_diffusion.components import Geometry
from trt_diffusion.errors import ConfigError
from trt_diffusion.export.modules import fuse_lora
from trt_diffusion.families import Component
from trt_diffusion.models.loading import load_component
from trt_diffusion.quantize.feeds import denoiser_interface
from trt_diffusion.quantize.stage import CALIBRATION_KIND, quantize, quantize_component
from trt_diffusion.spec import Size, load_engines_file

from .conftest import model_entry


@pytest.fixture(scope="module")
def lora_run(tiny_sd15_dir, tmp_path_factory):
    """sd15 with a ControlNet and a fused LoRA, int8: the base and the LoRA variant, through `quantize`."""
    root = tmp_path_factory.mktemp("quantize-lora")
    entry = model_entry(tiny_sd15_dir, "sd15", "int8")
    entry["controlnets"] = {"canny": {"source": str(tiny_sd15_dir / "controlnet")}}
    entry["loras"] = {"style": {"source": str(tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"),
                                "mode": "fused"}}
    config = root / "engines.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": "build"}, "models": {"m": entry}}))
    return config, quantize(config)


def test_each_fused_lora_gets_its_own_calibrated_gated_variant(lora_run):
    config, report = lora_run
    assert report.passed
    by_lora = {a.lora: a for a in report.artifacts}
    assert set(by_lora) == {None, "style"}
    base, styled = by_lora[None], by_lora["style"]
    assert base.key != styled.key and base.path != styled.path
    assert base.manifest["inputs"]["calibration"] != styled.manifest["inputs"]["calibration"]
    # the ControlNet of an int8 UNet defaults to fp16 (only denoisers are quantized): nothing unsupported
    assert report.unsupported == []
    assert styled.gate["passed"]  # measured against the fp32 UNet with the LoRA fused

    # each artifact is closer to its own fp32 model than to the other one: the LoRA is in the weights
    model = load_engines_file(config).models["m"]
    interface = denoiser_interface(model, styled.component)
    feeds = interface.definition.dummy_inputs(interface.config, interface.options, Geometry(2, Size(64, 64)))
    onnx_out = {a.lora: ort.InferenceSession(str(a.onnx_path)).run(None, feeds)[0] for a in (base, styled)}
    fp32_out = {}
    for lora in (None, "style"):
        module = load_component(model.source.path, Component.unet)
        if lora:
            fuse_lora(module, lora, model.loras[lora].path, 1.0, prefix="unet")
        with torch.no_grad():
            args = [torch.from_numpy(feeds[name]) for name in interface.input_names]
            fp32_out[lora] = interface.wrapper(module)(*args).numpy()

    def distance(a, b):
        return float(np.sqrt(np.mean((a - b) ** 2)))

    assert distance(fp32_out[None], fp32_out["style"]) > 0  # the LoRA does change the model
    assert distance(onnx_out["style"], fp32_out["style"]) < distance(onnx_out["style"], fp32_out[None])
    assert distance(onnx_out[None], fp32_out[None]) < distance(onnx_out[None], fp32_out["style"])


def test_a_unet_for_controlnets_takes_their_residuals(lora_run):
    config, report = lora_run
    model = load_engines_file(config).models["m"]
    interface = denoiser_interface(model, "unet")
    assert "mid_block_residual" in interface.input_names
    session = ort.InferenceSession(str(report.artifacts[0].onnx_path))
    assert [i.name for i in session.get_inputs()] == interface.input_names


def test_a_reexport_restores_the_calibration(quantized_matrix):
    model, first = quantized_matrix("sd15", "int8")
    workspace = first.path.parent.parent
    again = quantize_component(model, "unet", "int8", None, workspace, opset=19, held_out_samples=1)
    assert not again.cached and not again.recalibrated  # exported anew from the saved calibration
    assert again.key != first.key and again.manifest["opset"] == 19
    assert again.manifest["calibration_artifact"] == first.manifest["calibration_artifact"]
    assert again.state_path.read_bytes() == first.state_path.read_bytes()
    assert len(list((workspace / CALIBRATION_KIND).glob("m.unet.int8.*"))) == 1
    assert quantize_component(model, "unet", "int8", None, workspace, opset=19, held_out_samples=1).cached


def test_unknown_model_is_a_config_error(lora_run):
    config, _ = lora_run
    with pytest.raises(ConfigError, match="no model 'nope'"):
        quantize(config, "nope")
