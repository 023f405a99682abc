"""First-block caching's two FLUX graphs against diffusers' own hook (FirstBlockCacheConfig on the same
transformer), bit for bit: the runtime's rule (run the first block; skip the rest where its residual changed by at
most the threshold since the last full step) over `first_block` / `rest_blocks` gives the hook's outputs."""

from __future__ import annotations

import pytest
import torch

from trt_diffusion.components.first_block import FirstBlockFlux
from trt_diffusion.step_cache import first_block_skips


def load_transformer(folder):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(folder / "transformer").eval()


def call_inputs(transformer, steps: int, seed: int = 0, tokens: int = 16, text: int = 8):
    gen = torch.Generator().manual_seed(seed)
    config = transformer.config
    base = torch.randn(1, tokens, config.in_channels, generator=gen)
    # slowly drifting latents, as a denoising loop's: some steps change the first block's residual little
    samples = [base + 0.02 * i * torch.randn(1, tokens, config.in_channels, generator=gen) for i in range(steps)]
    side = int(tokens ** 0.5)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    fixed = dict(encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, generator=gen),
                 pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=gen),
                 img_ids=img_ids, txt_ids=torch.zeros(text, 3))
    if config.guidance_embeds:
        fixed["guidance"] = torch.tensor([3.5])
    timesteps = torch.linspace(1.0, 0.3, steps)
    return samples, timesteps, fixed


def reference(transformer, threshold, inputs):
    from diffusers import FirstBlockCacheConfig

    samples, timesteps, fixed = inputs
    transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        with transformer.cache_context("cond"):
            return [transformer(hidden_states=s, timestep=t.reshape(1), return_dict=False, **fixed)[0]
                    for s, t in zip(samples, timesteps)]
    finally:
        transformer.disable_cache()


def ours(transformer, threshold, inputs):
    samples, timesteps, fixed = inputs
    graphs = FirstBlockFlux(transformer)
    previous = tail = None
    out, skipped = [], []
    for sample, t in zip(samples, timesteps):
        guidance = fixed.get("guidance")
        hidden, encoder, residual, cached = graphs.first(
            sample, t.reshape(1), fixed["encoder_hidden_states"], fixed["pooled_projections"], fixed["img_ids"],
            fixed["txt_ids"], torch.zeros(1) if tail is None else tail, guidance)
        skip = tail is not None and first_block_skips(residual, previous, threshold)
        skipped.append(skip)
        if skip:
            out.append(cached)
            continue
        noise, tail = graphs.rest(hidden, encoder, t.reshape(1), fixed["pooled_projections"], fixed["img_ids"],
                                  fixed["txt_ids"], guidance)
        previous = residual
        out.append(noise)
    return out, skipped


@pytest.fixture(scope="module")
def flux(tiny_model_factory):
    return load_transformer(tiny_model_factory("flux"))


@torch.no_grad()
@pytest.mark.parametrize("threshold", [0.08, 0.5, 1e-6])
def test_the_schedule_equals_diffusers_first_block_cache(flux, threshold):
    inputs = call_inputs(flux, steps=6)
    expected = reference(flux, threshold, inputs)
    got, skipped = ours(flux, threshold, inputs)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"step {step} (skipped {skipped[step]}): max diff {(a - b).abs().max().item()}"
    if threshold == 1e-6:
        assert not any(skipped)  # nothing skips at a tiny threshold: the uncached transformer every step
        assert torch.equal(got[-1], flux(hidden_states=inputs[0][-1], timestep=inputs[1][-1].reshape(1),
                                         return_dict=False, **inputs[2])[0])
    if threshold == 0.5:
        assert any(skipped), "a threshold this large must skip some steps of slowly drifting latents"
