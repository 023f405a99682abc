"""Turn ModelOpt's FP8 export into standard ONNX Q/DQ that ONNX Runtime and strongly typed TensorRT run.

ModelOpt's legacy-exporter symbolic writes `trt::TRT_FP8QuantizeLinear` / `TRT_FP8DequantizeLinear` in a
custom domain. This pass, run exactly once per export:

- renames them to standard QuantizeLinear (with a float8e4m3fn zero point, saturating) / DequantizeLinear;
- stores weights as float8e4m3fn initializers behind a DequantizeLinear (Q on a constant folded offline:
  a quarter of the fp32 size, and the layout TensorRT's FP8 kernels expect);
- adds that weight DequantizeLinear to the Conv layers whose weight quantizer had to be off during export
  (the exporter cannot type a custom op's output as a Conv weight); only those: excluded Convs stay fp32;
- drops value_info, which still types the old Q outputs as uint8.

It is not idempotent (a second pass would find no trt nodes, or double the weight DQ), so the model is
stamped and a second run refused.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import QuantizeError
from ..onnx_facts import FP8_MAX, to_fp8  # noqa: F401 (FP8_MAX re-exported for the tests)

REWRITTEN_MARK = "trt_diffusion.fp8_qdq_rewritten"
TRT_DOMAIN = "trt"
MIN_OPSET = 19  # float8 QuantizeLinear/DequantizeLinear
_ZERO_POINT = "trt_diffusion_fp8_zero_point"


def is_rewritten(model: onnx.ModelProto) -> bool:
    return any(p.key == REWRITTEN_MARK for p in model.metadata_props)


def rewrite_fp8_qdq(model: onnx.ModelProto, conv_weight_amax: dict[str, float] | None = None,
                    base_dir: Path | None = None) -> onnx.ModelProto:
    """Rewrite in place (and return) `model`. `conv_weight_amax`: Conv weight initializer name -> amax.

    Weights stored as external data are read from `base_dir`, one at a time, as each is converted."""
    if is_rewritten(model):
        raise QuantizeError("this ONNX model's FP8 Q/DQ nodes were already rewritten; the pass runs once")
    graph = model.graph
    trt_nodes = [n for n in graph.node if n.domain == TRT_DOMAIN]
    if not trt_nodes:
        raise QuantizeError("no trt::TRT_FP8QuantizeLinear nodes: this is not a ModelOpt FP8 export")
    unknown = {n.op_type for n in trt_nodes} - {"TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear"}
    if unknown:
        raise QuantizeError(f"unsupported ops in the trt domain: {', '.join(sorted(unknown))}")

    graph.initializer.append(numpy_helper.from_array(np.zeros((), dtype=ml_dtypes.float8_e4m3fn), _ZERO_POINT))
    for node in trt_nodes:
        node.domain = ""
        if node.op_type == "TRT_FP8QuantizeLinear":
            node.op_type = "QuantizeLinear"
            node.input.append(_ZERO_POINT)
            node.attribute.append(helper.make_attribute("saturate", 1))
        else:
            node.op_type = "DequantizeLinear"

    folder = None if base_dir is None else str(base_dir)
    _fold_weight_quantize(graph, folder)
    _add_conv_weight_dequantize(graph, conv_weight_amax or {}, folder)
    _remove_unused(graph)

    graph.ClearField("value_info")
    kept = [o for o in model.opset_import if o.domain != TRT_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version < MIN_OPSET:
            opset.version = MIN_OPSET
    model.ir_version = max(model.ir_version, 9)  # float8 types
    model.metadata_props.append(onnx.StringStringEntryProto(key=REWRITTEN_MARK, value="1"))
    return model


def _constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers and Constant outputs by name, as protos: values are read only where needed (a
    full-size model's weights do not fit in memory twice)."""
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = node.attribute[0].t
    return values


def _fold_weight_quantize(graph: onnx.GraphProto, base_dir: str | None) -> None:
    """QuantizeLinear(fp32 weight initializer) -> a float8 initializer read by the DequantizeLinear."""
    initializers = {t.name: t for t in graph.initializer}
    constants = _constant_tensors(graph)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    folded = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in initializers:
            continue
        scale_tensor = constants.get(node.input[1])
        if scale_tensor is None or int(np.prod(scale_tensor.dims)) != 1:
            continue  # per-channel or non-constant scale: leave the Q in place
        scale = numpy_helper.to_array(scale_tensor, base_dir)
        weight = numpy_helper.to_array(initializers[node.input[0]], base_dir)
        fp8_name = f"{node.input[0]}_fp8"
        graph.initializer.append(numpy_helper.from_array(to_fp8(weight, float(scale)), fp8_name))
        for dq in consumers.get(node.output[0], []):
            dq.input[0] = fp8_name
        folded.append(node)
    for node in folded:
        graph.node.remove(node)


def _add_conv_weight_dequantize(graph: onnx.GraphProto, conv_weight_amax: dict[str, float],
                                base_dir: str | None) -> None:
    initializers = {t.name: t for t in graph.initializer}
    missing = [name for name in conv_weight_amax if name not in initializers]
    if missing:
        raise QuantizeError(f"FP8 Conv weights not found in the exported graph: {', '.join(missing[:3])}")
    new_nodes = []
    for index, node in enumerate(graph.node):
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in conv_weight_amax:
            continue
        weight_name = node.input[1]
        scale = np.float32(conv_weight_amax[weight_name] / FP8_MAX)
        weight = numpy_helper.to_array(initializers[weight_name], base_dir)
        base = weight_name.removesuffix(".weight")
        graph.initializer.append(numpy_helper.from_array(to_fp8(weight, float(scale)), f"{base}.weight_fp8"))
        graph.initializer.append(numpy_helper.from_array(np.array(scale, dtype=np.float32), f"{base}.weight_scale"))
        dq_out = f"{base}.weight_dequantized"
        new_nodes.append((index, helper.make_node(
            "DequantizeLinear", [f"{base}.weight_fp8", f"{base}.weight_scale"], [dq_out],
            name=f"/{base.replace('.', '/')}/weight_quantizer/DequantizeLinear")))
        node.input[1] = dq_out
    for offset, (index, dq) in enumerate(new_nodes):  # keep topological order: each DQ right before its Conv
        graph.node.insert(index + offset, dq)


def _remove_unused(graph: onnx.GraphProto) -> None:
    """Drop initializers and Constant nodes nothing reads any more (the folded fp32 weights)."""
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    dead_constants = [n for n in graph.node if n.op_type == "Constant" and n.output[0] not in used]
    for node in dead_constants:
        graph.node.remove(node)
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
