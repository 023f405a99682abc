"""The FP8 trt-domain rewrite on a small hand-made graph: ORT runs the result, and the pass runs once."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from trt_diffusion.errors import QuantizeError
from trt_diffusion.quantize.fp8_rewrite import FP8_MAX, REWRITTEN_MARK, rewrite_fp8_qdq


def _trt_qdq(prefix: str, tensor: str, scale: float) -> tuple[list, str]:
    """Constant scale -> TRT_FP8QuantizeLinear -> TRT_FP8DequantizeLinear, as ModelOpt's symbolic writes it."""
    q_scale, dq_scale = f"{prefix}/q_scale", f"{prefix}/dq_scale"
    nodes = [
        helper.make_node("Constant", [], [q_scale], value=numpy_helper.from_array(np.array(scale, np.float32))),
        helper.make_node("Constant", [], [dq_scale], value=numpy_helper.from_array(np.array(scale, np.float32))),
        helper.make_node("TRT_FP8QuantizeLinear", [tensor, q_scale], [f"{prefix}/q"], domain="trt"),
        helper.make_node("TRT_FP8DequantizeLinear", [f"{prefix}/q", dq_scale], [f"{prefix}/dq"], domain="trt"),
    ]
    return nodes, f"{prefix}/dq"


def _model() -> onnx.ModelProto:
    """x -> Q/DQ -> Conv(w_conv) -> Q/DQ -> MatMul(Q/DQ(w_mm)) -> y; a second Conv (excluded) stays fp32."""
    rng = np.random.default_rng(0)
    w_conv = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    w_keep = rng.standard_normal((4, 4, 1, 1)).astype(np.float32)
    w_mm = rng.standard_normal((6, 5)).astype(np.float32)
    nodes, x_dq = _trt_qdq("x", "x", 4.0 / FP8_MAX)
    nodes.append(helper.make_node("Conv", [x_dq, "model.conv.weight"], ["c"], pads=[1, 1, 1, 1]))
    nodes.append(helper.make_node("Conv", ["c", "model.keep.weight"], ["k"]))
    nodes.append(helper.make_node("Reshape", ["k", "shape"], ["r"]))
    more, r_dq = _trt_qdq("r", "r", 8.0 / FP8_MAX)
    nodes += more
    more, w_dq = _trt_qdq("w", "model.mm.weight", float(np.abs(w_mm).max()) / FP8_MAX)
    nodes += more
    nodes.append(helper.make_node("MatMul", [r_dq, w_dq], ["y"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 5])],
        initializer=[numpy_helper.from_array(w_conv, "model.conv.weight"),
                     numpy_helper.from_array(w_keep, "model.keep.weight"),
                     numpy_helper.from_array(w_mm, "model.mm.weight"),
                     numpy_helper.from_array(np.array([-1, 6], np.int64), "shape")],
        value_info=[helper.make_tensor_value_info("x/q", TensorProto.UINT8, [1, 3, 2, 3])],  # stale, as exported
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("trt", 1)])


def _fp32_reference(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    """The same graph with every Q/DQ removed (weights and activations in fp32)."""
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    graph = plain.graph
    q_input = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "TRT_FP8QuantizeLinear"}
    rename = {n.output[0]: q_input[n.input[0]] for n in graph.node if n.op_type == "TRT_FP8DequantizeLinear"}
    kept = [n for n in graph.node if n.domain != "trt" and n.op_type != "Constant"]
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    del graph.node[:]
    graph.node.extend(kept)
    del graph.value_info[:]
    del plain.opset_import[:]
    plain.opset_import.append(helper.make_opsetid("", 17))
    return ort.InferenceSession(plain.SerializeToString()).run(None, {"x": x})[0]


def test_rewritten_graph_runs_in_onnxruntime_and_stays_close_to_fp32():
    model = _model()
    x = np.random.default_rng(1).standard_normal((1, 3, 2, 3)).astype(np.float32)
    # ORT refuses the trt domain: the reason the pass exists
    with pytest.raises(Fail, match="trt:TRT_FP8QuantizeLinear.* is not a registered function/op"):
        ort.InferenceSession(model.SerializeToString())
    reference = _fp32_reference(x, model)
    rewritten = rewrite_fp8_qdq(model, {"model.conv.weight": float(np.abs(
        numpy_helper.to_array(model.graph.initializer[0])).max())})

    assert not [n for n in rewritten.graph.node if n.domain == "trt"]
    assert {o.domain for o in rewritten.opset_import} == {""}
    assert rewritten.opset_import[0].version >= 19
    assert len(rewritten.graph.value_info) == 0
    assert any(p.key == REWRITTEN_MARK for p in rewritten.metadata_props)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("QuantizeLinear") == 2  # the two activations; the MatMul weight is stored as fp8
    assert ops.count("DequantizeLinear") == 4  # two activations, the MatMul weight, the quantized Conv weight
    by_name = {t.name: t for t in rewritten.graph.initializer}
    assert by_name["model.conv.weight_fp8"].data_type == TensorProto.FLOAT8E4M3FN
    assert by_name["model.mm.weight_fp8"].data_type == TensorProto.FLOAT8E4M3FN
    assert "model.mm.weight" not in by_name  # the fp32 copy of a folded weight is gone
    assert by_name["model.keep.weight"].data_type == TensorProto.FLOAT  # not listed: stays fp32, no DQ
    keep_conv = next(n for n in rewritten.graph.node if n.op_type == "Conv" and "model.keep.weight" in n.input)
    assert keep_conv.input[1] == "model.keep.weight"

    onnx.checker.check_model(rewritten)
    got = ort.InferenceSession(rewritten.SerializeToString()).run(None, {"x": x})[0]
    assert np.isfinite(got).all()
    assert np.abs(got - reference).max() < 0.15 * np.abs(reference).max()  # fp8 rounding, not garbage


def test_second_run_is_refused():
    rewritten = rewrite_fp8_qdq(_model(), {})
    with pytest.raises(QuantizeError, match="already rewritten"):
        rewrite_fp8_qdq(rewritten, {})


def test_a_graph_without_trt_nodes_is_refused():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    with pytest.raises(QuantizeError, match="not a ModelOpt FP8 export"):
        rewrite_fp8_qdq(helper.make_model(graph), {})
