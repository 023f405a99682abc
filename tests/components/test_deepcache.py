"""DeepCache's two UNet graphs against the DeepCache package (its hooks on the same diffusers UNet), bit for bit:
`unet_deep` is the UNet, and a schedule of deep and shallow calls is DeepCacheSDHelper's at every branch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trt_diffusion.components.deepcache import DeepCacheUNet, feature_decl
from trt_diffusion.step_cache import deepcache_full_steps

DeepCache = pytest.importorskip("DeepCache")


def load_unet(folder):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder / "unet").eval()


def call_inputs(unet, steps: int, seed: int = 0, batch: int = 2, side: int = 8):
    gen = torch.Generator().manual_seed(seed)
    config = unet.config
    cross = config.cross_attention_dim
    cross = cross[0] if isinstance(cross, (list, tuple)) else cross
    ehs = torch.randn(batch, 77, cross, generator=gen)
    added = None
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        added = {"text_embeds": torch.randn(batch, pooled, generator=gen),
                 "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch)}
    timesteps = torch.linspace(999, 0, steps).round()
    samples = [torch.randn(batch, config.in_channels, side, side, generator=gen) for _ in range(steps)]
    return timesteps, samples, ehs, added


def reference_noise(unet, branch: int, interval: int, steps: int, inputs):
    """The DeepCache package's schedule: it finds the step index from pipe.scheduler.timesteps. Its branch ids are
    block × 3 + layer whatever the UNet (SD1.5's two layers per block); ours are block × (layers + 1) + layer, the
    same ids on SD1.5 and SDXL, so the tiny UNet's (one layer per block) are translated."""
    from DeepCache import DeepCacheSDHelper

    timesteps, samples, ehs, added = inputs
    cut = DeepCacheUNet(unet, branch).cut
    helper = DeepCacheSDHelper(pipe=SimpleNamespace(unet=unet, scheduler=SimpleNamespace(timesteps=timesteps)))
    helper.set_params(cache_interval=interval, cache_branch_id=cut.block * 3 + cut.layer)
    helper.enable()
    try:
        return [unet(samples[i], timesteps[i].reshape(1), ehs, added_cond_kwargs=added, return_dict=False)[0]
                for i in range(steps)]
    finally:
        helper.disable()


def cached_noise(unet, branch: int, interval: int, steps: int, inputs):
    timesteps, samples, ehs, added = inputs
    model = DeepCacheUNet(unet, branch)
    feature, out = None, []
    for i, full in enumerate(deepcache_full_steps(steps, interval)):
        t = timesteps[i].reshape(1)
        if full:
            noise, feature = model.forward_deep(samples[i], t, ehs, added)
        else:
            noise = model.forward_shallow(samples[i], t, ehs, feature, added)
        out.append(noise)
    return out


@pytest.fixture(scope="module")
def sd15_unet(tiny_model_factory):
    return load_unet(tiny_model_factory("sd15"))


@torch.no_grad()
# the tiny UNet: 2 blocks × (1 layer + 1); the default run keeps the default branch, the deeper ones are slow
@pytest.mark.parametrize("branch", [0, *(pytest.param(b, marks=pytest.mark.slow) for b in (1, 2, 3))])
def test_sd15_schedule_equals_the_deepcache_package(sd15_unet, branch):
    steps, interval = 5, 3
    inputs = call_inputs(sd15_unet, steps)
    expected = reference_noise(sd15_unet, branch, interval, steps, inputs)
    got = cached_noise(sd15_unet, branch, interval, steps, inputs)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"
    # the cached steps differ from the uncached UNet: the schedule really skipped work
    uncached = sd15_unet(inputs[1][1], inputs[0][1].reshape(1), inputs[2], return_dict=False)[0]
    assert not torch.equal(uncached, got[1])


@torch.no_grad()
def test_sd15_deep_graph_is_the_unet_and_its_feature_is_declared(sd15_unet):
    timesteps, samples, ehs, _ = call_inputs(sd15_unet, 1)
    for branch in range(4):
        noise, feature = DeepCacheUNet(sd15_unet, branch).forward_deep(samples[0], timesteps[0].reshape(1), ehs)
        assert torch.equal(noise, sd15_unet(samples[0], timesteps[0].reshape(1), ehs, return_dict=False)[0])
        decl = feature_decl(sd15_unet.config, DeepCacheUNet(sd15_unet, branch).cut)
        assert tuple(feature.shape) == decl.shape({"batch": 2, "height": 8, "width": 8})


@torch.no_grad()
@pytest.mark.slow  # sdxl: the same code path as sd15 with its added conditioning (~7 s)
def test_sdxl_schedule_equals_the_deepcache_package(tiny_model_factory):
    unet = load_unet(tiny_model_factory("sdxl"))
    steps = 4
    inputs = call_inputs(unet, steps, seed=1)
    for branch in (0, 2):
        expected = reference_noise(unet, branch, 2, steps, inputs)
        got = cached_noise(unet, branch, 2, steps, inputs)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), branch


@torch.no_grad()
def test_controlnet_residuals_enter_both_graphs(sd15_unet):
    """The deep graph takes every residual, the shallow one those of the skip connections it computes (a prefix);
    the package's hooks see the same residuals through the UNet's own arguments."""
    from DeepCache import DeepCacheSDHelper

    from trt_diffusion.components.unet import residual_layout

    steps, interval, branch = 4, 2, 1
    timesteps, samples, ehs, _ = call_inputs(sd15_unet, steps, seed=3)
    gen = torch.Generator().manual_seed(9)
    layout = residual_layout(sd15_unet.config)
    channels = sd15_unet.config.block_out_channels
    down = [[torch.randn(2, c, 8 // 2 ** level, 8 // 2 ** level, generator=gen) for c, level in layout]
            for _ in range(steps)]
    mid = [torch.randn(2, channels[-1], 8 // 2 ** (len(channels) - 1), 8 // 2 ** (len(channels) - 1), generator=gen)
           for _ in range(steps)]
    helper = DeepCacheSDHelper(pipe=SimpleNamespace(unet=sd15_unet, scheduler=SimpleNamespace(timesteps=timesteps)))
    cut = DeepCacheUNet(sd15_unet, branch).cut
    helper.set_params(cache_interval=interval, cache_branch_id=cut.block * 3 + cut.layer)
    helper.enable()
    try:
        expected = [sd15_unet(samples[i], timesteps[i].reshape(1), ehs, down_block_additional_residuals=down[i],
                              mid_block_additional_residual=mid[i], return_dict=False)[0] for i in range(steps)]
    finally:
        helper.disable()
    model, feature = DeepCacheUNet(sd15_unet, branch), None
    for i, full in enumerate(deepcache_full_steps(steps, interval)):
        t = timesteps[i].reshape(1)
        if full:
            noise, feature = model.forward_deep(samples[i], t, ehs, None, down[i], mid[i])
        else:
            noise = model.forward_shallow(samples[i], t, ehs, feature, None, down[i][:cut.fresh_residuals])
        assert torch.equal(noise, expected[i]), i
