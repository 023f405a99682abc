"""Q/DQ over fp16: the graph an fp8/int8 TensorRT engine is built from.

A strongly typed engine runs every tensor in the type the graph gives it. The quantize stage writes its
Q/DQ ONNX over the fp32 graph (what the onnxruntime target runs), so built as it is, every layer TensorRT
leaves unquantized (normalizations, softmax, the layers the quantize stage excluded) would run in fp32/TF32.
This pass makes the float parts fp16 while the I/O stays fp32: float32 weights, Q/DQ scales, Constant
values and Cast targets become float16 (DequantizeLinear then yields fp16, as its scale's type decides),
Casts at the graph inputs and outputs keep the engine's contract. Pure ONNX; no TensorRT.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import BuildError
from ..onnx_facts import onnx_sha256

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
FP16_MAX = 65504.0
MIN_OPSET = 19  # QuantizeLinear/DequantizeLinear take float16 scales from opset 19 on
# (op_type, input index) that the ONNX standard keeps float32 whatever the graph's precision
FLOAT32_INPUTS = frozenset({("Resize", 2), ("Upsample", 1)})


def _fp16(tensor: onnx.TensorProto, base_dir: str) -> onnx.TensorProto:
    array = numpy_helper.to_array(tensor, base_dir=base_dir)
    return numpy_helper.from_array(np.clip(array, -FP16_MAX, FP16_MAX).astype(np.float16), tensor.name)


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def qdq_over_fp16(model: onnx.ModelProto, base_dir: str | Path = "") -> onnx.ModelProto:
    """The model with its float32 compute made float16 and fp32 I/O kept (in place; returned)."""
    if _default_opset(model) < MIN_OPSET:
        raise BuildError(f"a Q/DQ graph over fp16 needs opset {MIN_OPSET} or newer (float16 scales); this one has "
                         f"opset {_default_opset(model)}: quantize with `opset: {MIN_OPSET}` or newer")
    graph, base = model.graph, str(base_dir)
    keep32 = {node.input[i] for node in graph.node for op, i in FLOAT32_INPUTS
              if node.op_type == op and len(node.input) > i}
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == FLOAT and tensor.name not in keep32:
            graph.initializer[index].CopyFrom(_fp16(tensor, base))
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == FLOAT:
                attribute.i = FLOAT16
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FLOAT:
                if not any(out in keep32 for out in node.output):
                    attribute.t.CopyFrom(_fp16(attribute.t, base))
    renamed: list[onnx.NodeProto] = []
    for value in graph.input:
        if value.type.tensor_type.elem_type == FLOAT:
            half = value.name + "__fp16"
            for node in graph.node:
                node.input[:] = [half if name == value.name else name for name in node.input]
            renamed.append(helper.make_node("Cast", [value.name], [half], to=FLOAT16, name=half + "_cast"))
    outputs: list[onnx.NodeProto] = []
    for value in graph.output:
        if value.type.tensor_type.elem_type == FLOAT:
            half = value.name + "__fp16"
            for node in graph.node:
                node.output[:] = [half if name == value.name else name for name in node.output]
                node.input[:] = [half if name == value.name else name for name in node.input]
            outputs.append(helper.make_node("Cast", [half], [value.name], to=FLOAT, name=value.name + "_cast"))
    nodes = [*renamed, *graph.node, *outputs]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]  # stale float32 types; TensorRT and ONNX Runtime infer them
    return model


def _digest(onnx_path: Path) -> str:
    return hashlib.sha256(f"qdq-fp16-v1:{onnx_sha256(onnx_path)}".encode()).hexdigest()[:16]


def qdq_fp16_onnx(onnx_path: str | Path, cache_dir: str | Path) -> Path:
    """`<cache_dir>/<key>/model.onnx`: the Q/DQ-over-fp16 form of a quantized ONNX, made once per source
    (keyed on its content hash) and committed by renaming a finished folder, so a half-written one is never used."""
    onnx_path, cache_dir = Path(onnx_path), Path(cache_dir)
    folder = cache_dir / _digest(onnx_path)
    converted = folder / "model.onnx"
    if converted.is_file():
        return converted
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache_dir))
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
        qdq_over_fp16(model, onnx_path.parent)
        onnx.load_external_data_for_model(model, str(onnx_path.parent))
        onnx.save(model, str(staging / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="model.onnx.data", size_threshold=1024)
        try:
            os.rename(staging, folder)
        except OSError:  # another build committed it first: theirs is the same
            if not converted.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return converted
