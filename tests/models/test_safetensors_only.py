"""Weights are read from .safetensors only; pickled .bin files are refused with one clear error, for model
components, the calibration pipeline and fused LoRAs alike (issue 20, item 5)."""

from __future__ import annotations

import shutil

import pytest

from trt_diffusion.errors import ModelError
from trt_diffusion.families import Component
from trt_diffusion.models.loading import load_component


@pytest.fixture(scope="module")
def pickled_model(tiny_sd15_dir, tmp_path_factory):
    """The tiny sd15 model with its UNet and text encoder re-saved as pickled .bin files."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("pickled") / "model"
    shutil.copytree(tiny_sd15_dir, out)
    for sub, name in (("unet", "diffusion_pytorch_model.bin"), ("text_encoder", "pytorch_model.bin")):
        (weights,) = (out / sub).glob("*.safetensors")
        torch.save(load_file(weights), out / sub / name)  # the names diffusers / transformers look for
        weights.unlink()
    return out


@pytest.mark.parametrize("component", [Component.unet, Component.text_encoder])
def test_a_pickled_component_is_refused(pickled_model, component):
    with pytest.raises(ModelError, match="no .safetensors weights.*pickled weights can run code"):
        load_component(pickled_model, component)


def test_the_calibration_pipeline_refuses_pickled_weights(pickled_model):
    from trt_diffusion.quantize.calibration import load_pipeline

    with pytest.raises(ModelError, match="cannot load the pipeline"):
        load_pipeline(pickled_model)


def test_a_fused_lora_must_be_safetensors(tiny_sd15_dir, tmp_path):
    from trt_diffusion.export.modules import fuse_lora

    pickled = tmp_path / "style.bin"
    shutil.copyfile(tiny_sd15_dir / "lora" / "pytorch_lora_weights.safetensors", pickled)
    unet = load_component(tiny_sd15_dir, Component.unet)
    with pytest.raises(ModelError, match="only .safetensors files are read"):
        fuse_lora(unet, "style", pickled, 1.0, prefix="unet")


def test_safetensors_components_still_load(tiny_sd15_dir):
    assert load_component(tiny_sd15_dir, Component.unet) is not None
