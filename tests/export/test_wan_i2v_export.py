"""Wan image-to-video export: the CLIP image encoder (which caught graphsurgeon folding a sliced Shape to the
whole shape), the whole-clip VAE encoder per frame count, the 36-channel transformer with image cross-attention,
and (slow) every component of both I2V checkpoints exported and verified against PyTorch (the exports
built_wan_i2v's build made, shared with the I2V parity, preflight and serving tests)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.export.test_wan_export import _io_dims, _spec, _static
from trt_diffusion import api
from trt_diffusion.components import get_component, load_model_config
from trt_diffusion.export import group_specs
from trt_diffusion.export.graph_passes import _explicit_shape_slices, _fold_and_clean
from trt_diffusion.export.shapes import export_shapes


@pytest.fixture(scope="module")
def wan21_i2v(tiny_model_factory):
    return tiny_model_factory("wan", variant="i2v")


def test_a_sliced_shape_folds_to_its_slice():
    """Expand(0, Shape(w, end=1)) is a bias-free Conv's zero bias: it must fold to [out_channels], not w's shape."""
    weight = helper.make_tensor_value_info("w", TensorProto.FLOAT, [32, 3, 14, 14])
    nodes = [helper.make_node("Shape", ["w"], ["n"], end=1),
             helper.make_node("ConstantOfShape", ["n"], ["bias"],
                              value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0]))]
    graph = helper.make_graph(nodes, "g", [weight], [helper.make_tensor_value_info("bias", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    _explicit_shape_slices(model.graph)
    _fold_and_clean(model, "t")
    (folded,) = model.graph.initializer
    assert list(onnx.numpy_helper.to_array(folded).shape) == [32]


def test_i2v_transformer_takes_36_channels_and_the_image_tokens(wan21_i2v):
    config = load_model_config(wan21_i2v, "wan", "transformer")
    io = get_component("wan", "transformer").io(config, {})
    dims = {d.name: d.dim_names() for d in io.inputs}
    assert dims["hidden_states"] == ("batch", 36, "latent_frames", "height", "width")
    assert dims["encoder_hidden_states_image"] == ("batch", 5, 32)  # (28 / 14)^2 + the class token, CLIP width


def test_vae_encoder_is_exported_at_its_frame_count(wan21_i2v):
    config = load_model_config(wan21_i2v, "wan", "vae_encoder")
    definition = get_component("wan", "vae_encoder")
    (group,) = group_specs([_spec("vae_encoder", _static("32x32x9"))])
    assert group.name == "w.vae_encoder.9frames.fp32"
    shapes = export_shapes(group, definition, config)
    io = shapes.graph_io(definition.io(config, {}))
    assert io.inputs[0].dim_names() == ("batch", 3, 9, "image_height", "image_width")
    assert io.outputs[0].dim_names() == ("batch", 16, 3, "height", "width")


def test_image_encoder_exports_and_matches_pytorch(wan21_i2v, tmp_path, write_engines_yaml):
    config = write_engines_yaml(tmp_path, wan21_i2v, "wan", buckets=["32x32x5"], workflows=["img2vid"],
                                precision={"image_encoder": "fp32"})
    (result,) = api.export(config, component="image_encoder").results
    assert result.group.name == "wan-tiny.image_encoder.fp32"
    assert result.parity and all(c["passed"] for c in result.parity)
    assert max(c["max_rel"] for c in result.parity) < 1e-5
    assert _io_dims(result.onnx_path) == {"pixel_values": ["batch", 3, 28, 28], "image_embeds": ["batch", 5, 32]}


@pytest.mark.slow  # five dynamo exports per checkpoint (about 50 s each on 2 cores): those built_wan_i2v's build made
@pytest.mark.parametrize("variant", ["i2v", "i2v_two_expert"])
def test_every_i2v_component_exports_and_matches_pytorch(built_wan_i2v, variant):
    config = built_wan_i2v(variant)  # its build exported every component through api.export's path
    results = {r.group.name: r for r in api.export(config).results}
    assert all(r.cached for r in results.values())  # the build's verified artifacts, found by their inputs' hash
    experts = ["transformer", "transformer_2"] if variant == "i2v_two_expert" else ["transformer"]
    expected = {"wan.text_encoder.fp32", "wan.vae_encoder.5frames.fp32", "wan.vae_decoder.5frames.fp32",
                *(f"wan.{e}.fp32" for e in experts)}
    if variant == "i2v":
        expected.add("wan.image_encoder.fp32")
    assert set(results) == expected
    for result in results.values():
        assert result.parity and all(c["passed"] for c in result.parity), result.parity
    encoder = results["wan.vae_encoder.5frames.fp32"]
    assert _io_dims(encoder.onnx_path) == {"video": ["batch", 3, 5, "image_height", "image_width"],
                                           "latent": ["batch", 16, 2, "height", "width"]}
    for expert in experts:
        dims = _io_dims(results[f"wan.{expert}.fp32"].onnx_path)
        assert dims["hidden_states"] == ["batch", 36, "latent_frames", "height", "width"]
        assert ("encoder_hidden_states_image" in dims) == (variant == "i2v")
    assert np.isfinite([c["max_rel"] for c in encoder.parity]).all()
