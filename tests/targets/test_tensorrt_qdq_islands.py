"""The Q/DQ base graph keeps what the fp16 export keeps in fp32 (#27 items 1 and 2), on ONNX Runtime (CPU).

Item 1: the sinusoidal timestep / SDXL `time_ids` embedding (arguments up to ~1000, where fp16's spacing is
0.5) and the RMSNorm variance (x² overflows fp16 above 256) stay float32 islands in the Q/DQ-over-fp16
graph, as diffusers computes them in fp32 under `.half()`. Item 2: the Q/DQ base is chosen per family (bf16
for the DiT families, whose activations exceed fp16's range), and the bf16 graph is accepted by the
precision check; the bf16 test is structural (ORT's CPU provider has no bf16 kernels, and tiny random DiTs
do not overflow fp16).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.errors import BuildError
from trt_diffusion.targets.tensorrt.precision import check_onnx_precision, qdq_base_precision
from trt_diffusion.targets.tensorrt.qdq_fp16 import qdq_over_fp16, qdq_over_precision

HALF = 8  # sinusoid frequencies


def _q(name, values):
    return numpy_helper.from_array(np.asarray(values), name)


def time_embedding_block(int_timestep: bool = False) -> onnx.ModelProto:
    """diffusers' get_timestep_embedding -> Q/DQ linear_1, plus an RMSNorm over a Q/DQ'd activation,
    as the fp32 Q/DQ export writes them (no casts mark the fp32 parts: the whole graph is fp32)."""
    rng = np.random.default_rng(0)
    inits = [
        _q("start", np.int64(0)), _q("limit", np.int64(HALF)), _q("delta", np.int64(1)),
        _q("neg_log", np.float32(-math.log(10000.0) / HALF)), _q("freq_shape", np.array([1, HALF], np.int64)),
        _q("w.q", rng.integers(-127, 128, (2 * HALF, 16)).astype(np.int8)),
        _q("w.scale", np.float32(0.01)), _q("w.zp", np.int8(0)),
        _q("x.scale", np.float32(4.0)), _q("x.zp", np.int8(0)),
        _q("two", np.float32(2.0)), _q("eps", np.float32(1e-6)),
        _q("norm.weight", rng.uniform(0.5, 1.5, 16).astype(np.float32)),
        _q("axes", np.array([-1], np.int64)),
    ]
    nodes = [  # the frequencies as dynamo writes them: exp(arange(half) * -log(10000) / half), Range over floats
        *[helper.make_node("Cast", [n], [n + "_f"], to=TensorProto.FLOAT) for n in ("start", "limit", "delta")],
        helper.make_node("Range", ["start_f", "limit_f", "delta_f"], ["arange"]),
        helper.make_node("Mul", ["arange", "neg_log"], ["exponent"]),
        helper.make_node("Exp", ["exponent"], ["freqs_flat"]),
        helper.make_node("Reshape", ["freqs_flat", "freq_shape"], ["freqs"]),
    ]
    if int_timestep:
        nodes.append(helper.make_node("Cast", ["timestep"], ["t_f"], to=TensorProto.FLOAT))
        t = "t_f"
    else:
        t = "timestep"
    nodes += [
        helper.make_node("Unsqueeze", [t, "axes"], ["t2"]),
        helper.make_node("Mul", ["t2", "freqs"], ["args"]),
        helper.make_node("Sin", ["args"], ["sin"]),
        helper.make_node("Cos", ["args"], ["cos"]),
        helper.make_node("Concat", ["sin", "cos"], ["t_emb"], axis=-1),
        helper.make_node("DequantizeLinear", ["w.q", "w.scale", "w.zp"], ["w"]),
        helper.make_node("MatMul", ["t_emb", "w"], ["emb"]),
        # RMSNorm (diffusers: variance = x.float().pow(2).mean(-1); x * rsqrt(variance + eps) * weight)
        helper.make_node("QuantizeLinear", ["hidden", "x.scale", "x.zp"], ["h_q"]),
        helper.make_node("DequantizeLinear", ["h_q", "x.scale", "x.zp"], ["h"]),
        helper.make_node("Pow", ["h", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Div", ["h", "std"], ["normed"]),
        helper.make_node("Mul", ["normed", "norm.weight"], ["rms"]),
    ]
    t_type = TensorProto.INT64 if int_timestep else TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "time_block",
        [helper.make_tensor_value_info("timestep", t_type, [1]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, 4, 16])],
        [helper.make_tensor_value_info("t_emb", TensorProto.FLOAT, [1, 2 * HALF]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, 16]),
         helper.make_tensor_value_info("rms", TensorProto.FLOAT, [1, 4, 16])],
        initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    return {v.name: v.type.tensor_type.elem_type for v in values}


def run(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("int_timestep", [False, True])
def test_time_embedding_and_rmsnorm_variance_stay_fp32_in_the_fp16_graph(int_timestep):
    timestep = np.array([999], np.int64 if int_timestep else np.float32)
    hidden = np.random.default_rng(1).uniform(-500, 500, (1, 4, 16)).astype(np.float32)  # x² > 65504
    feeds = {"timestep": timestep, "hidden": hidden}
    reference = run(time_embedding_block(int_timestep), feeds)
    converted = qdq_over_fp16(time_embedding_block(int_timestep))
    onnx.checker.check_model(converted, full_check=True)
    got = run(converted, feeds)
    assert all(v.dtype == np.float32 for v in got.values())  # fp32 I/O kept
    np.testing.assert_allclose(got["t_emb"], reference["t_emb"], atol=1e-3)  # the sinusoid in fp32
    np.testing.assert_allclose(got["rms"], reference["rms"], rtol=2e-2, atol=2e-2)
    # ORT's CPU provider widens fp16 Pow/ReduceMean itself, so x² cannot overflow here: the variance's types are
    # checked instead (TensorRT runs a float16 Pow in fp16, where x = 500 gives inf)
    types = _types(converted)
    assert types["sq"] == types["var"] == types["std"] == types["normed"] == TensorProto.FLOAT
    scale = float(np.abs(reference["emb"]).max())
    np.testing.assert_allclose(got["emb"], reference["emb"], atol=2e-2 * scale)  # linear_1 runs in fp16
    by_name = {t.name: t.data_type for t in converted.graph.initializer}
    assert by_name["neg_log"] == by_name["two"] == by_name["eps"] == TensorProto.FLOAT  # island constants
    assert by_name["norm.weight"] == TensorProto.FLOAT16  # the rest is fp16
    assert by_name["w.scale"] == TensorProto.FLOAT  # a weight's DQ scale stays exact, then a Cast (#45 item 7)
    matmul = next(n for n in converted.graph.node if n.op_type == "MatMul")
    cast = next(n for n in converted.graph.node if matmul.input[0] in n.output)
    assert cast.op_type == "Cast" and helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT16


# ---------------------------------------------------------------------------------------------- item 2


def _spec(family: str, precision: str, component: str = "transformer") -> EngineSpec:
    return EngineSpec(model="m", family=family, source="s", component=component, target="tensorrt",
                      precision=precision, batch=1, bucket=Bucket.static(Size(512, 512)))


def test_qdq_base_is_bf16_for_dit_families_and_fp16_for_unets():
    assert qdq_base_precision(_spec("flux", "fp8")) == qdq_base_precision(_spec("sd3", "int8")) == "bf16"
    assert qdq_base_precision(_spec("flux", "fp8", "text_encoder_2")) == "bf16"  # T5 overflows fp16 too
    assert qdq_base_precision(_spec("sd15", "int8", "unet")) == qdq_base_precision(_spec("sdxl", "fp8", "unet")) == "fp16"
    for precision in ("fp32", "fp16", "bf16"):
        assert qdq_base_precision(_spec("flux", precision)) == precision  # unquantized: the spec's own


def test_check_onnx_precision_takes_qdq_over_bf16_for_dits_only():
    check_onnx_precision(_spec("flux", "fp8"), "bfloat16")
    check_onnx_precision(_spec("sdxl", "int8", "unet"), "float16")
    with pytest.raises(BuildError, match="Q/DQ ONNX over the bf16 graph"):
        check_onnx_precision(_spec("flux", "fp8"), "float16")  # an fp16 base would overflow
    with pytest.raises(BuildError, match="Q/DQ ONNX over the fp16 graph"):
        check_onnx_precision(_spec("sd15", "int8", "unet"), "bfloat16")


def test_qdq_over_bf16_makes_a_valid_bf16_graph_with_fp32_io_and_islands():
    converted = qdq_over_precision(time_embedding_block(), "bf16")
    onnx.checker.check_model(converted, full_check=True)
    by_name = {t.name: t.data_type for t in converted.graph.initializer}
    assert by_name["norm.weight"] == TensorProto.BFLOAT16
    assert by_name["w.scale"] == TensorProto.FLOAT  # the weight's DQ yields exact fp32, cast to bf16 (#45 item 7)
    assert by_name["neg_log"] == TensorProto.FLOAT  # the sinusoid island stays fp32 over bf16 too
    casts = {helper.get_attribute_value(a) for n in converted.graph.node if n.op_type == "Cast" for a in n.attribute}
    assert TensorProto.FLOAT16 not in casts and TensorProto.BFLOAT16 in casts
    assert [v.type.tensor_type.elem_type for v in converted.graph.output] == [TensorProto.FLOAT] * 3


@pytest.mark.slow
def test_a_dynamo_export_of_tiny_sdxl_and_flux_keeps_valid_fp32_islands(tmp_path):
    """On real exports (tiny SDXL UNet: timestep and time_ids; tiny FLUX transformer: timestep, guidance, rotary
    embeddings, RMSNorm): the fp16 base is a valid graph ONNX Runtime runs (the pass before #27 made every dynamo
    export invalid: a float Range lowered to fp16), within fp16 rounding of fp32, and the bf16 base passes the
    checker. About 20 s (two dynamo exports)."""
    import torch

    from trt_diffusion.models.tiny import build_tiny_pipeline
    from trt_diffusion.targets.tensorrt.fp32_islands import fp32_island_nodes

    class SDXL(torch.nn.Module):
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, x, t, e, te, ti):
            return self.unet(x, t, e, added_cond_kwargs={"text_embeds": te, "time_ids": ti}, return_dict=False)[0]

    class FLUX(torch.nn.Module):
        def __init__(self, transformer):
            super().__init__()
            self.transformer = transformer

        def forward(self, h, e, p, t, img, txt, g):
            return self.transformer(hidden_states=h, encoder_hidden_states=e, pooled_projections=p, timestep=t,
                                    img_ids=img, txt_ids=txt, guidance=g, return_dict=False)[0]

    torch.manual_seed(0)
    unet = build_tiny_pipeline("sdxl").unet.eval()
    c = unet.config
    sdxl_inputs = (torch.randn(1, 4, 8, 8), torch.tensor([999.0]), torch.randn(1, 77, c.cross_attention_dim),
                   torch.randn(1, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim),
                   torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]]))
    torch.manual_seed(0)
    transformer = build_tiny_pipeline("flux").transformer.eval()
    f = transformer.config
    flux_inputs = (torch.randn(1, 16, f.in_channels), torch.randn(1, 8, f.joint_attention_dim),
                   torch.randn(1, f.pooled_projection_dim), torch.tensor([0.999]), torch.zeros(16, 3),
                   torch.zeros(8, 3), torch.tensor([3.5]))
    for name, module, inputs in (("sdxl", SDXL(unet).eval(), sdxl_inputs), ("flux", FLUX(transformer).eval(), flux_inputs)):
        path = tmp_path / f"{name}.onnx"
        with torch.no_grad():
            torch.onnx.export(module, inputs, str(path), dynamo=True, optimize=False, opset_version=20)
        model = onnx.load(str(path))
        feeds = {i.name: a.numpy() for i, a in zip(model.graph.input, inputs)}
        reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        islands = fp32_island_nodes(model)
        assert {"Sin", "Cos", "Range"} <= {model.graph.node[i].op_type for i in islands}, name
        converted = qdq_over_fp16(onnx.load(str(path)))
        onnx.checker.check_model(converted)
        got = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.abs(got - reference).max() < 5e-3 * max(1.0, float(np.abs(reference).max())), name
        onnx.checker.check_model(qdq_over_precision(onnx.load(str(path)), "bf16"))
