"""The Z-Image transformer's traced computation (components/z_image.py `_tensor_forward`: diffusers' list forward
written over padded tensors, rotary embedding in real cos/sin) against diffusers' own forward on the tiny model:
rows of different prompt lengths in one call (a masked batch, as ZImagePipeline's CFG call), lengths on both sides
of a multiple of 32, square and non-square latents; and the declaration's profile over the text axis."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trt_diffusion.components import Geometry, get_component, load_model_config
from trt_diffusion.components.z_image import padded_rows
from trt_diffusion.engines_file import Bucket, EngineSpec, Size
from trt_diffusion.families import Component
from trt_diffusion.models.loading import load_component


@pytest.fixture(scope="module")
def transformer(tiny_model_factory):
    folder = tiny_model_factory("z_image")
    config = load_model_config(folder, "z_image", "transformer")
    return get_component("z_image", "transformer"), config, load_component(folder, Component.transformer)


@pytest.mark.parametrize("lengths,latent", [((20, 45), (8, 8)), ((33, 7, 64), (8, 12)), ((32,), (10, 6))],
                         ids=["two-rows", "three-rows-nonsquare", "one-row-at-32"])
def test_the_traced_computation_equals_diffusers_forward(transformer, lengths, latent):
    definition, config, module = transformer
    wrapper = definition.wrapper(module, config, {})
    gen = np.random.default_rng(len(lengths))
    rows = [gen.standard_normal((n, int(config["cap_feat_dim"]))).astype(np.float32) for n in lengths]
    embeds, mask = padded_rows(rows)
    latents = gen.standard_normal((len(lengths), 16, *latent)).astype(np.float32)
    timestep = gen.uniform(0, 1, len(lengths)).astype(np.float32)
    feeds = [torch.from_numpy(v) for v in (latents, timestep, embeds, mask)]
    with torch.inference_mode():
        reference = wrapper(*feeds)  # diffusers' forward over the unpadded lists
        expected = module([torch.from_numpy(x)[:, None] for x in latents], torch.from_numpy(timestep),
                          [torch.from_numpy(r) for r in rows], return_dict=False)[0]
        with definition.export_context():
            traced = wrapper(*feeds)
    np.testing.assert_array_equal(reference.numpy(), torch.stack(expected).squeeze(2).numpy())
    assert traced.shape == reference.shape == (len(lengths), 16, *latent)
    np.testing.assert_allclose(traced.numpy(), reference.numpy(), rtol=0, atol=1e-5)  # seen: identical


def test_the_profile_spans_the_bucket_and_the_text_length(transformer):
    definition, config, _ = transformer
    spec = EngineSpec(model="z", family="z_image", source="local:x", component="transformer", target="onnxruntime",
                      precision="fp32", batch=2, bucket=Bucket(Size(64, 64), Size(96, 64), Size(128, 96)),
                      build_options=(("opset", 20),))
    profile = definition.profile(spec, config)
    assert profile["hidden_states"] == ((2, 16, 8, 8), (2, 16, 8, 12), (2, 16, 12, 16))
    assert profile["encoder_hidden_states"] == ((2, 2, 16), (2, 128, 16), (2, 512, 16))
    assert profile["encoder_hidden_states_mask"] == ((2, 2), (2, 128), (2, 512))
    assert definition.io(config, {}).inputs[3].dtype == "int64"
    assert definition.shapes(config, {}, Geometry(2, Size(64, 64), text=40))["encoder_hidden_states"] == (2, 40, 16)
