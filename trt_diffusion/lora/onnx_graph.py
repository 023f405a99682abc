"""Read-only views of an ONNX graph that refit maps need: initializers, their values, node scopes.

A node's scope is the torch module that produced it: the dynamo exporter writes it in the node's
`pkg.torch.onnx.name_scopes` metadata, the legacy exporter in the node name (`/unet/down_blocks.1/.../to_q/MatMul`).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cached_property
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import RefitError
from ..onnx_facts import load_onnx_structure

# Ops that pass a weight through unchanged in value (up to layout) between an initializer and its consumer.
PASS_THROUGH_OPS = frozenset({"Transpose", "Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten"})
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                         onnx.TensorProto.DOUBLE})
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def node_scope(node: onnx.NodeProto) -> str | None:
    """The module path (dot-separated) a node was exported from, or None when the export did not say."""
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES_KEY:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            # the last entry names the op itself; the one before is the deepest module
            return scopes[-2] if isinstance(scopes, list) and len(scopes) >= 2 and scopes[-2] else None
    if node.name.startswith("/"):
        parts = node.name.strip("/").split("/")
        return ".".join(parts[:-1]) or None
    return None


def graph_consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Tensor name -> the nodes that read it, in graph order."""
    found: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found


def external_data_files(model: onnx.ModelProto) -> list[str]:
    locations = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(entry.value for entry in tensor.external_data if entry.key == "location")
    return sorted(locations)


def load_structure(onnx_path: str | Path) -> onnx.ModelProto:
    """The graph without its weights; a missing or corrupt file is one RefitError."""
    return load_onnx_structure(onnx_path, error=RefitError)


class OnnxGraph:
    """An ONNX model's structure, with initializer values read from external data only on demand."""

    def __init__(self, onnx_path: str | Path):
        self.path = Path(onnx_path)
        self.model = load_structure(self.path)
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in self.model.graph.initializer}
        self._values: dict[str, np.ndarray] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.initializers[name].dims)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.initializers[name].data_type))

    def is_external(self, name: str) -> bool:
        return self.initializers[name].data_location == onnx.TensorProto.EXTERNAL

    def is_float(self, name: str) -> bool:
        return self.initializers[name].data_type in FLOAT_TYPES

    def value(self, name: str, cache: bool = False) -> np.ndarray:
        """The initializer's values; `cache` keeps them for repeated comparisons (memory: a full UNet is GBs)."""
        if name in self._values:
            return self._values[name]
        value = numpy_helper.to_array(self.initializers[name], base_dir=str(self.path.parent))
        if cache:
            self._values[name] = value
        return value

    @cached_property
    def producers(self) -> dict[str, onnx.NodeProto]:
        return {output: node for node in self.model.graph.node for output in node.output}

    @cached_property
    def nodes_by_scope(self) -> dict[str, list[onnx.NodeProto]]:
        index: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.model.graph.node:
            scope = node_scope(node)
            if scope is not None:
                index[scope].append(node)
        return dict(index)

    def weight_inputs(self, node: onnx.NodeProto) -> list[tuple[int, str]]:
        """(input index, initializer name) of each input that is an initializer, directly or through
        value-preserving ops (a Transpose of the weight, a Cast to fp16...)."""
        found = []
        for index, name in enumerate(node.input):
            seen = 0
            while name and name not in self.initializers and name in self.producers and seen < 4:
                producer = self.producers[name]
                if producer.op_type not in PASS_THROUGH_OPS or not producer.input:
                    break
                name, seen = producer.input[0], seen + 1
            if name in self.initializers:
                found.append((index, name))
        return found
