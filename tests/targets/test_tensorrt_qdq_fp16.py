"""fp8/int8 TensorRT engines are built from Q/DQ over fp16 (strong typing: the unquantized layers run in the
graph's float type). The pass is checked on CPU: the converted graph is valid ONNX, keeps fp32 I/O, has fp16
weights and scales, and ONNX Runtime gives the fp32 Q/DQ graph's outputs to fp16 rounding."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_diffusion.errors import BuildError
from trt_diffusion.onnx_facts import onnx_compute_dtype, onnx_io
from trt_diffusion.targets.tensorrt.qdq_fp16 import qdq_fp16_onnx, qdq_over_fp16


def qdq_unet_block(opset: int = 19, w_scale=None, x_scale: float = 0.05) -> onnx.ModelProto:
    """Q/DQ conv -> InstanceNorm (unquantized, must run fp16) -> Resize (fp32 scales by the standard) -> out."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(x_scale, np.float32), "x.scale"),
        numpy_helper.from_array(np.array(0, np.int8), "x.zero_point"),
        numpy_helper.from_array(rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8), "conv.weight_q"),
        numpy_helper.from_array(np.full(8, 0.01, np.float32) if w_scale is None else w_scale, "w.scale"),
        numpy_helper.from_array(np.zeros(8, np.int8), "w.zero_point"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "conv.bias"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "norm.weight"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "norm.bias"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "resize.scales"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["sample", "x.scale", "x.zero_point"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x.scale", "x.zero_point"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["conv.weight_q", "w.scale", "w.zero_point"], ["w_dq"], axis=0),
        helper.make_node("Conv", ["x_dq", "w_dq", "conv.bias"], ["h"], pads=[1, 1, 1, 1]),
        helper.make_node("InstanceNormalization", ["h", "norm.weight", "norm.bias"], ["n"]),
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32))),
        helper.make_node("Mul", ["n", "two"], ["m"]),
        helper.make_node("Resize", ["m", "", "resize.scales"], ["out"], mode="nearest"),
    ]
    graph = helper.make_graph(nodes, "qdq_block",
                              [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, 16, 16])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, feeds) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_qdq_over_fp16_keeps_io_and_outputs_and_runs_the_rest_in_fp16(tmp_path):
    source = qdq_unet_block()
    onnx.checker.check_model(source)
    feeds = {"sample": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    expected = run(source, feeds)

    converted = qdq_over_fp16(qdq_unet_block())
    onnx.checker.check_model(converted, full_check=True)
    by_name = {t.name: t for t in converted.graph.initializer}
    assert by_name["x.scale"].data_type == TensorProto.FLOAT16  # the activation's Q takes its input's type
    assert by_name["w.scale"].data_type == TensorProto.FLOAT  # a weight's DQ keeps its exact scale (#45 item 7)
    assert by_name["norm.weight"].data_type == by_name["conv.bias"].data_type == TensorProto.FLOAT16
    assert by_name["resize.scales"].data_type == TensorProto.FLOAT  # the standard keeps Resize scales fp32
    assert by_name["conv.weight_q"].data_type == TensorProto.INT8
    got = run(converted, feeds)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * float(np.abs(expected).max()))

    path = tmp_path / "qdq.onnx"
    onnx.save(qdq_unet_block(), str(path))
    fp16_path = qdq_fp16_onnx(path, tmp_path / "cache")
    assert onnx_compute_dtype(path) == "float32" and onnx_compute_dtype(fp16_path) == "float16"
    inputs, outputs = onnx_io(fp16_path)
    assert [t.dtype for t in inputs + outputs] == ["float32", "float32"]
    assert qdq_fp16_onnx(path, tmp_path / "cache") == fp16_path  # made once per source
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [fp16_path.parent.name]  # no staging left


def test_qdq_over_fp16_needs_opset_19():
    with pytest.raises(BuildError, match="needs opset 19 or newer .* this one has opset 17"):
        qdq_over_fp16(qdq_unet_block(opset=17))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_weight_scales_stay_fp32_and_activation_scales_never_round_to_zero(precision):
    """#45 item 7: lowered to fp16, a weight scale below 6.1e-5 became subnormal (here 2-40 % off) and one below
    3e-8 zero; lowered to bf16 every channel lost up to 0.4 %. A weight's DQ now keeps its fp32 scale (the weight
    is exact, then cast); an activation scale is lowered (Q takes its input's type) but never below fp16's
    smallest normal, so Q never divides by zero."""
    from trt_diffusion.targets.tensorrt.qdq_fp16 import FP16_MIN_NORMAL, qdq_over_precision

    w_scale = np.array([1e-6, 3e-6, 2e-5, 4e-5, 1e-8, 0.01, 0.0123457, 0.3], np.float32)  # subnormal, zero, bf16-lossy
    converted = qdq_over_precision(qdq_unet_block(w_scale=w_scale, x_scale=1e-9), precision)
    onnx.checker.check_model(converted, full_check=precision == "fp16")  # the ONNX standard has no bf16 Conv
    by_name = {t.name: t for t in converted.graph.initializer}
    assert by_name["w.scale"].data_type == TensorProto.FLOAT
    np.testing.assert_array_equal(numpy_helper.to_array(by_name["w.scale"]), w_scale)  # bit for bit
    dq = next(n for n in converted.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "conv.weight_q")
    conv = next(n for n in converted.graph.node if n.op_type == "Conv")
    cast = next(n for n in converted.graph.node if n.output and n.output[0] == conv.input[1])
    assert cast.op_type == "Cast" and cast.input[0] == dq.output[0]  # exact fp32 weight, then the base type
    x_scale = numpy_helper.to_array(by_name["x.scale"]).astype(np.float32)
    if precision == "fp16":
        assert float(x_scale) >= FP16_MIN_NORMAL  # 1e-9 would round to 0 in fp16
    else:
        assert float(x_scale) > 0
    if precision == "fp16":  # ONNX Runtime's CPU kernels run the fp16 graph: the DQ'd weights are the fp32 ones
        feeds = {"sample": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)}
        got = run(converted, feeds)
        assert np.isfinite(got).all()
