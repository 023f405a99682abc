"""The DiT (FLUX.1) micro-model's architectures (issue 43): FLUX's block layout at small widths (double-stream
blocks, then single-stream blocks), its 16-channel VAE packed 2x2 into 64 transformer channels, and one
flow-matching training step of the script's own loss that reaches every trained part. `models micro --family flux`
writes a FluxPipeline folder (the shipped folder stood in for by the untrained modules saved as fp16)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from trt_diffusion.cli import main
from trt_diffusion.models import micro

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_the_flux_micro_architectures_keep_fluxs_layout():
    torch.manual_seed(0)
    transformer, vae = micro.flux_transformer(), micro.flux_vae()
    assert len(transformer.transformer_blocks) >= 2 and len(transformer.single_transformer_blocks) >= 2
    assert transformer.config.patch_size == 1 and transformer.config.in_channels == 64
    assert sum(transformer.config.axes_dims_rope) == transformer.config.attention_head_dim
    assert vae.config.latent_channels == micro.FLUX_LATENT_CHANNELS == 16
    assert len(vae.config.block_out_channels) == 4  # SD's 8x spatial factor: 64x64 images, 8x8 latents, 16 tokens
    assert vae.quant_conv is None and vae.post_quant_conv is None  # as FLUX.1's VAE
    text_encoder, text_encoder_2 = micro.flux_text_encoder(), micro.flux_t5_encoder()
    assert text_encoder.config.hidden_size == transformer.config.pooled_projection_dim
    assert text_encoder_2.config.d_model == transformer.config.joint_attention_dim
    with torch.no_grad():
        latents = vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist.mean
    assert latents.shape == (1, 16, 8, 8)


def test_one_flow_matching_step_gives_a_finite_loss_that_reaches_every_trained_part():
    from train_micro import flux_loss, flux_text

    from trt_diffusion.models.tiny import _clip_tokenizer, _t5_tokenizer

    torch.manual_seed(0)
    transformer, text_encoder, text_encoder_2 = \
        micro.flux_transformer(), micro.flux_text_encoder(), micro.flux_t5_encoder()
    captions = ["a red circle on a blue background", ""]
    pooled, states = flux_text(text_encoder, text_encoder_2, _clip_tokenizer(), _t5_tokenizer(), captions)
    loss = flux_loss(transformer, pooled, states, torch.randn(2, micro.FLUX_LATENT_CHANNELS, 8, 8))
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    for part in (transformer.transformer_blocks[0], transformer.single_transformer_blocks[-1], text_encoder,
                 text_encoder_2):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters()), type(part).__name__


@pytest.fixture
def shipped_flux(tmp_path, monkeypatch):
    from diffusers import FluxPipeline

    from trt_diffusion.models.tiny import _clip_tokenizer, _t5_tokenizer

    data = tmp_path / "data"
    monkeypatch.setattr(micro, "DATA", data)
    torch.manual_seed(0)
    pipe = FluxPipeline(scheduler=micro.flux_scheduler(), vae=micro.flux_vae(), text_encoder=micro.flux_text_encoder(),
                        tokenizer=_clip_tokenizer(), text_encoder_2=micro.flux_t5_encoder(),
                        tokenizer_2=_t5_tokenizer(), transformer=micro.flux_transformer())
    pipe.to(torch.float16).save_pretrained(data / "flux", safe_serialization=True)
    (data / "flux" / micro.TRAINING_RECORD).write_text(json.dumps({"vocabulary": micro.VOCABULARY, "seed": 0}))


def test_models_micro_writes_the_flux_micro_model_as_an_fp32_flux_pipeline(shipped_flux, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "micro-flux"
    assert main(["models", "micro", "--family", "flux", "--out", str(out)]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert micro.draws_synthetic_world(out)
    with safe_open(str(out / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as handle:
        assert str(handle.get_tensor(next(iter(handle.keys()))).dtype) == "torch.float32"
