"""bf16 graphs on a CPU: ONNX Runtime has no bf16 kernels there (a bf16 Conv is an invalid graph to it),
so export-time parity runs a widened copy: every bfloat16 tensor type, weight and Cast of the graph made
float32. bf16 -> fp32 is exact, so the copy computes with exactly the exported weights in fp32 math: it
proves the export's weights and wiring; the bf16 arithmetic itself is what TensorRT runs (tested against
torch's bf16 module in tests/export/test_bf16_export.py).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

BF16, FP32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT


def _widen_tensor(tensor: onnx.TensorProto, base_dir: str) -> None:
    if tensor.data_type == BF16:
        array = numpy_helper.to_array(tensor, base_dir=base_dir).astype(np.float32)
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))


def _widen_type(value: onnx.ValueInfoProto) -> None:
    tensor_type = value.type.tensor_type
    if tensor_type.elem_type == BF16:
        tensor_type.elem_type = FP32


def _widen_nodes(nodes, base_dir: str) -> None:
    for node in nodes:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.INT and attribute.name in ("to", "dtype") and attribute.i == BF16:
                attribute.i = FP32
            elif attribute.type == onnx.AttributeProto.TENSOR:
                _widen_tensor(attribute.t, base_dir)
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _widen_graph(attribute.g, base_dir)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for graph in attribute.graphs:
                    _widen_graph(graph, base_dir)


def _widen_graph(graph: onnx.GraphProto, base_dir: str) -> None:
    for tensor in graph.initializer:
        _widen_tensor(tensor, base_dir)
    for value in [*graph.input, *graph.output, *graph.value_info]:
        _widen_type(value)
    _widen_nodes(graph.node, base_dir)


def widen_bf16(model: onnx.ModelProto, base_dir: str | Path = "") -> onnx.ModelProto:
    """The model with every bfloat16 made float32, in place (external data read from `base_dir`)."""
    _widen_graph(model.graph, str(base_dir))
    for function in model.functions:
        _widen_nodes(function.node, str(base_dir))
    return model


def bf16_tensor_count(model: onnx.ModelProto) -> int:
    """bfloat16 initializers of the main graph (0 after `widen_bf16`)."""
    return sum(tensor.data_type == BF16 for tensor in model.graph.initializer)


@contextlib.contextmanager
def widened_for_parity(onnx_path: str | Path) -> Iterator[Path]:
    """A float32 copy of a bf16 ONNX (external data beside it) in a temporary folder, removed on exit."""
    onnx_path = Path(onnx_path)
    folder = Path(tempfile.mkdtemp(prefix=".bf16-parity-", dir=onnx_path.parent))
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
        widen_bf16(model, onnx_path.parent)
        onnx.load_external_data_for_model(model, str(onnx_path.parent))  # what stayed fp32 (int tensors, ...)
        target = folder / onnx_path.name
        onnx.save(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=target.name + ".data", size_threshold=1024)
        yield target
    finally:
        shutil.rmtree(folder, ignore_errors=True)
