"""Which layers are quantized: every Linear/Conv minus the default and user exclusion globs."""

from __future__ import annotations

import pytest

from trt_diffusion.families import Component
from trt_diffusion.models.loading import load_component
from trt_diffusion.quantize.defaults import DEFAULT_EXCLUDE
from trt_diffusion.quantize.exclusions import quantizable_layers, select_layers


@pytest.fixture(scope="module")
def sd15_unet(tiny_model_factory):
    return load_component(tiny_model_factory("sd15"), Component.unet)


@pytest.fixture(scope="module")
def sd3_transformer(tiny_model_factory):
    return load_component(tiny_model_factory("sd3"), Component.transformer)


def test_defaults_keep_first_last_and_embedding_layers_in_higher_precision(sd15_unet):
    selection = select_layers(sd15_unet)
    for name in ("conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2",
                 "down_blocks.0.resnets.0.time_emb_proj", "down_blocks.1.resnets.0.conv_shortcut"):
        assert name in selection.excluded, name
    assert "down_blocks.0.resnets.0.conv1" in selection.quantized
    assert "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q" in selection.quantized
    # a Transformer2DModel's proj_out is an inner layer: only the top-level (final) proj_out is excluded
    assert "down_blocks.1.attentions.0.proj_out" in selection.quantized
    assert set(selection.quantized) | set(selection.excluded) == set(quantizable_layers(sd15_unet))
    assert selection.patterns == DEFAULT_EXCLUDE


def test_dit_defaults_keep_embedders_final_layer_and_modulation(sd3_transformer):
    selection = select_layers(sd3_transformer)
    for name in ("pos_embed.proj", "context_embedder", "proj_out", "norm_out.linear",
                 "time_text_embed.timestep_embedder.linear_1", "transformer_blocks.0.norm1.linear"):
        assert name in selection.excluded, name
    assert "transformer_blocks.0.attn.to_q" in selection.quantized
    assert "transformer_blocks.0.ff.net.2" in selection.quantized


def test_user_patterns_add_exclusions_and_bang_reincludes(sd15_unet):
    selection = select_layers(sd15_unet, ["*attn2*", "!conv_in"])
    assert selection.excluded["down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k"] == "*attn2*"
    assert "conv_in" in selection.quantized
    assert "conv_out" in selection.excluded


def test_a_pattern_on_a_parent_covers_its_children(sd15_unet):
    selection = select_layers(sd15_unet, ["mid_block"])
    mid = [n for n in quantizable_layers(sd15_unet) if n.startswith("mid_block.")]
    assert mid and all(selection.excluded[n] in ("mid_block", "*time_emb_proj", "*norm*") for n in mid)
