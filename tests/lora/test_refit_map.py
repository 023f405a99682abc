"""Refit maps: by name behind a prefix, through the consuming node (transposed MatMul weights), by value."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from trt_diffusion.errors import RefitError
from trt_diffusion.lora import REFIT_MAP_FILE, MatchedBy, RefitMap, build_refit_map
from trt_diffusion.lora.onnx_graph import NAME_SCOPES_KEY

ATTENTION_WEIGHT = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"


def _initializer_value(onnx_path, name: str) -> np.ndarray:
    model = onnx.load(str(onnx_path))
    return onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _assert_map_holds_the_weights(refit_map: RefitMap, onnx_path, unet: torch.nn.Module) -> None:
    model = onnx.load(str(onnx_path))
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for param, target in refit_map.targets.items():
        weight = unet.get_parameter(param).detach().numpy()
        expected = (weight.T if target.transpose else weight).reshape(target.shape)
        assert np.array_equal(values[target.initializer], expected), param


def test_project_export_maps_every_parameter_by_name(dynamo_onnx, base_unet):
    refit_map = build_refit_map(dynamo_onnx, base_unet)
    assert refit_map.prefix == ""  # the export strips its wrapper's prefix
    assert len(refit_map.targets) == len(list(base_unet.parameters())) and not refit_map.unmapped
    assert {t.matched_by for t in refit_map.targets.values()} == {MatchedBy.name}
    target = refit_map.targets[ATTENTION_WEIGHT]
    assert (target.initializer, target.transpose) == (ATTENTION_WEIGHT, False)
    _assert_map_holds_the_weights(refit_map, dynamo_onnx, base_unet)


def test_legacy_export_finds_transposed_matmul_weights_through_their_node(legacy_onnx, base_unet):
    refit_map = build_refit_map(legacy_onnx, base_unet, by_value=False)
    assert refit_map.prefix == "unet."  # conv weights keep their names behind the wrapper's attribute name
    target = refit_map.targets[ATTENTION_WEIGHT]
    assert target.initializer.startswith("onnx::MatMul_")  # a made-up name: found through the node
    assert target.transpose and target.matched_by is MatchedBy.node
    assert not refit_map.unmapped
    counts = Counter((t.matched_by, t.transpose) for t in refit_map.targets.values())
    assert counts[(MatchedBy.node, True)] >= 32  # at least every attention projection
    _assert_map_holds_the_weights(refit_map, legacy_onnx, base_unet)


@pytest.mark.slow  # an optimized dynamo export of the UNet (about 10 s)
def test_optimized_dynamo_export_uses_node_metadata(base_unet, helpers, tmp_path):
    optimized = helpers.export_unet(base_unet, tmp_path / "optimized.onnx", dynamo=True, optimize=True)
    graph = onnx.load(str(optimized), load_external_data=False).graph
    assert any(p.key == NAME_SCOPES_KEY for node in graph.node for p in node.metadata_props)
    refit_map = build_refit_map(optimized, base_unet, by_value=False)
    assert refit_map.prefix == "unet."
    target = refit_map.targets[ATTENTION_WEIGHT]
    assert target.initializer.startswith("val_") and target.transpose and target.matched_by is MatchedBy.node
    assert not refit_map.unmapped
    _assert_map_holds_the_weights(refit_map, optimized, base_unet)


def test_value_fallback_when_nodes_say_nothing(legacy_onnx, base_unet, tmp_path):
    model = onnx.load(str(legacy_onnx))
    for index, node in enumerate(model.graph.node):
        node.name = f"n{index}"  # no module path left in any node
        del node.metadata_props[:]
    anonymous = tmp_path / "anonymous.onnx"
    onnx.save(model, str(anonymous))
    refit_map = build_refit_map(anonymous, base_unet)
    target = refit_map.targets[ATTENTION_WEIGHT]
    assert target.transpose and target.matched_by is MatchedBy.value
    assert not refit_map.unmapped
    _assert_map_holds_the_weights(refit_map, anonymous, base_unet)
    without_values = build_refit_map(anonymous, base_unet, by_value=False)
    assert ATTENTION_WEIGHT in without_values.unmapped


def test_shapes_only_map_agrees_on_linear_weights(legacy_onnx, base_unet):
    shapes = {name: tuple(p.shape) for name, p in base_unet.named_parameters()}
    by_shape = build_refit_map(legacy_onnx, shapes)
    by_value = build_refit_map(legacy_onnx, base_unet)
    assert by_shape.targets[ATTENTION_WEIGHT] == by_value.targets[ATTENTION_WEIGHT]
    for param, target in by_shape.targets.items():
        assert (target.initializer, target.transpose) == (by_value.targets[param].initializer,
                                                          by_value.targets[param].transpose), param


def test_save_load_round_trip_and_onnx_identity(dynamo_onnx, legacy_onnx, base_unet, tmp_path):
    refit_map = build_refit_map(legacy_onnx, base_unet)
    written = refit_map.save(tmp_path)
    assert written.name == REFIT_MAP_FILE
    data = json.loads(written.read_text())
    assert data["schema_version"] == 1 and len(data["onnx_sha256"]) == 64
    loaded = RefitMap.load(tmp_path, onnx_path=legacy_onnx)
    assert loaded == refit_map
    with pytest.raises(RefitError, match="built for another ONNX"):
        RefitMap.load(written, onnx_path=dynamo_onnx)
    written.write_text(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(RefitError, match="schema_version 99"):
        RefitMap.load(written)



def test_weights_of_another_checkpoint_are_not_mapped(dynamo_onnx, base_unet):
    other = {name: p.detach().clone() for name, p in base_unet.named_parameters()}
    other[ATTENTION_WEIGHT] += 0.01
    refit_map = build_refit_map(dynamo_onnx, other)
    assert list(refit_map.unmapped) == [ATTENTION_WEIGHT]
    assert "holds other values" in refit_map.unmapped[ATTENTION_WEIGHT]
