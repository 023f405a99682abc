"""Parity's reference for a fused-LoRA variant: the LoRA merged into the torch denoiser. A LoRA file as diffusers
saves it names its UNet keys `unet.…`; the reference must find them (it once asked for keys starting with '.': every
fused variant's parity stopped with "matches no layer")."""

from __future__ import annotations

import torch

from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.parity.stage import _reference


def test_the_reference_of_a_fused_variant_carries_the_lora(tmp_path, tiny_model_factory, write_engines_yaml):
    model = tiny_model_factory("sd15", lora=True)
    lora = {"style": {"source": str(model / "lora" / "pytorch_lora_weights.safetensors"), "mode": "fused",
                      "scale": 1.0}}
    config = load_engines_file(write_engines_yaml(tmp_path, model, "sd15", loras=lora))
    (name,) = config.models

    def unet_weights(table):
        unet = next(e for e in table.entries if e.component == "unet").runner.module.model
        return {k: v.clone() for k, v in unet.state_dict().items()}

    base, fused = unet_weights(_reference(config, name, None)), unet_weights(_reference(config, name, "style"))
    assert base.keys() == fused.keys()  # merged: no adapter left behind
    assert any(not torch.equal(base[k], fused[k]) for k in base)
