"""Clean up the exporter's raw graph without touching parameter names.

1. Initializers get the component's own parameter names (the wrapper's `model.` prefix is stripped).
   First, every input dim declared dynamic must be dynamic in the raw graph: torch.onnx.export(dynamo=True)
   can freeze a dim to the example's size without an error (docs/video.md), and the renaming would hide it.
2. Inputs and outputs get the declared dim names (`batch`, `height`, `image_height`...) instead of the
   exporter's `s53` / `2*height_units`. Intermediate shapes are *not* stored: ONNX shape inference gives
   every element of a sequence the first element's shape (FLUX splits text and image tokens through
   SplitToSequence), and ONNX Runtime then plans buffers from the wrong shapes. Runtimes infer their own.
3. onnx-graphsurgeon folds constants, removes dead nodes and sorts — with the parameters hidden from it
   as graph inputs, so no weight is folded into a new, unnamed constant (a Linear weight's Transpose, say):
   refit finds every weight under its torch name. The result must pass ONNX's type-checked, strict
   shape inference, or folding is retried more conservatively. graphsurgeon folds a `Shape` node to its
   input's whole shape, ignoring opset 15's `start`/`end` (a bias-free Conv's zero bias is
   `Expand(0, Shape(weight, end=1))`: CLIP's patch embedding got a [32, 3, 14, 14] bias), so such nodes are
   first rewritten as a whole `Shape` and a `Slice`, which it folds right.
4. Weights are streamed into one `<name>.onnx.data` file beside the graph, without loading them all.

Only the graph skeleton (small constants included) is ever held in memory.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from ..components.base import ComponentIO, TensorDecl
from ..errors import ExportError

log = logging.getLogger(__name__)

INLINE_LIMIT = 1024  # tensors at least this large go to the external-data file
ALIGN_THRESHOLD = 1 << 20  # tensors at least this large start at an mmap-friendly offset
ALIGNMENT = mmap.ALLOCATIONGRANULARITY


@dataclass(frozen=True)
class GraphSummary:
    nodes_before: int
    nodes_after: int
    initializers: int
    parameters: int  # initializers named after a torch parameter
    unused_parameters: tuple[str, ...]  # torch parameters the graph does not use (the VAE encoder's in the decoder)
    onnx_bytes: int
    data_bytes: int

    def to_json(self) -> dict:
        shown = list(self.unused_parameters[:10]) + (["..."] if len(self.unused_parameters) > 10 else [])
        return {**self.__dict__, "unused_parameters": len(self.unused_parameters), "unused_parameter_names": shown}


def finalize_graph(raw_path: Path, out_path: Path, io: ComponentIO, parameter_names: set[str], prefix: str,
                   label: str) -> GraphSummary:
    model = onnx.load(str(raw_path), load_external_data=False)
    nodes_before = len(model.graph.node)
    strip_prefix(model.graph, prefix)
    _check_io(model.graph, io, label)
    _check_dynamic_inputs(model.graph, io, label)
    _apply_declared_dims(model.graph, io)
    del model.graph.value_info[:]  # the exporter's dim expressions; shape inference writes clean ones

    names = {init.name for init in model.graph.initializer}
    exported_parameters = names & parameter_names
    weights = _detach_parameters(model.graph, exported_parameters | _split_buffers(model.graph, names))
    _load_small_tensors(model.graph, raw_path.parent)
    _typed_constants(model.graph)
    _explicit_shape_slices(model.graph)
    _fold_and_clean(model, label)
    model = onnx.load_from_string(model.SerializeToString())  # fresh proto after graphsurgeon
    _attach_parameters(model.graph, weights)

    kept = {init.name for init in model.graph.initializer}
    lost = sorted(exported_parameters - kept)
    if lost:  # the passes never drop a weight the exporter kept: that would break refit
        raise RuntimeError(f"{label}: graph passes lost parameter initializers {lost[:5]}")
    _apply_declared_dims(model.graph, io)

    data_name = out_path.name + ".data"
    data_bytes = write_external_data(model.graph, raw_path.parent, out_path.parent / data_name, data_name)
    onnx.save_model(model, str(out_path))
    try:
        onnx.checker.check_model(str(out_path))
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{label}: the cleaned graph is not valid ONNX: {str(exc).splitlines()[0]}") from exc
    return GraphSummary(
        nodes_before=nodes_before, nodes_after=len(model.graph.node), initializers=len(model.graph.initializer),
        parameters=len(kept & parameter_names), unused_parameters=tuple(sorted(parameter_names - kept)),
        onnx_bytes=out_path.stat().st_size, data_bytes=data_bytes,
    )


# --- names ------------------------------------------------------------------------------------


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _graphs(sub)


def strip_prefix(graph: onnx.GraphProto, prefix: str) -> None:
    """Rename `prefix`-ed initializers (the wrapper's parameters) to the component's own parameter names."""
    renames = {init.name: init.name[len(prefix):] for init in graph.initializer if init.name.startswith(prefix)}
    if not renames:
        return
    taken = {name for g in _graphs(graph) for node in g.node for name in node.output}
    taken |= {i.name for i in graph.input} | {init.name for init in graph.initializer}
    clashes = sorted(set(renames.values()) & (taken - set(renames)))
    if clashes:
        raise RuntimeError(f"stripping {prefix!r} from initializer names would clash with {clashes[:5]}")
    for init in graph.initializer:
        init.name = renames.get(init.name, init.name)
    for g in _graphs(graph):
        for node in g.node:
            for i, name in enumerate(node.input):
                if name in renames:
                    node.input[i] = renames[name]
        for value in (*g.output, *g.value_info):
            value.name = renames.get(value.name, value.name)


def _check_io(graph: onnx.GraphProto, io: ComponentIO, label: str) -> None:
    initializers = {init.name for init in graph.initializer}
    got_inputs = [i.name for i in graph.input if i.name not in initializers]
    got_outputs = [o.name for o in graph.output]
    if got_inputs != io.input_names or got_outputs != io.output_names:
        raise RuntimeError(f"{label}: exported I/O {got_inputs} -> {got_outputs} differs from the declaration "
                           f"{io.input_names} -> {io.output_names}")


def _check_dynamic_inputs(graph: onnx.GraphProto, io: ComponentIO, label: str) -> None:
    """ExportError naming every declared-dynamic input dim the exporter wrote as a fixed size."""
    inputs = {i.name: i for i in graph.input}
    frozen = []
    for decl in io.inputs:
        dims = inputs[decl.name].type.tensor_type.shape.dim
        for index, (declared, got) in enumerate(zip(decl.dims, dims)):
            if not isinstance(declared, int) and got.HasField("dim_value"):
                frozen.append(f"'{decl.name}' dim {index} ({declared.name}) is fixed at {got.dim_value}")
    if frozen:
        raise ExportError(f"{label}: the exporter froze dims declared dynamic, so the graph would serve only the "
                          f"example's size: {'; '.join(frozen)}. Something in the model specializes on that size "
                          f"(a Python int or loop over it); export that axis per size, or rewrite the offending code")


def _set_dims(value: onnx.ValueInfoProto, decl: TensorDecl) -> None:
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for dim in decl.dim_names():
        entry = shape.dim.add()
        if isinstance(dim, int):
            entry.dim_value = dim
        else:
            entry.dim_param = dim


def _apply_declared_dims(graph: onnx.GraphProto, io: ComponentIO) -> None:
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    for decl in io.inputs:
        _set_dims(inputs[decl.name], decl)
    for decl in io.outputs:
        _set_dims(outputs[decl.name], decl)


# --- hiding weights from constant folding -----------------------------------------------------


def _detach_parameters(graph: onnx.GraphProto, names: set[str]) -> list[TensorProto]:
    """Move parameter initializers out of the graph; they become graph inputs while the passes run."""
    weights = [init for init in graph.initializer if init.name in names]
    keep = [init for init in graph.initializer if init.name not in names]
    detached = [TensorProto() for _ in weights]
    for copy, original in zip(detached, weights):
        copy.CopyFrom(original)
    del graph.initializer[:]
    graph.initializer.extend(keep)
    graph.input.extend(helper.make_tensor_value_info(w.name, w.data_type, list(w.dims)) for w in detached)
    return detached


def _split_buffers(graph: onnx.GraphProto, initializers: set[str]) -> set[str]:
    """Constants a SplitToSequence splits (Wan's RoPE tables): folded, they become a sequence, a list that
    graphsurgeon cannot store ('list' object has no attribute 'nbytes'), and the whole graph would stay unfolded.
    They are hidden from folding like the parameters."""
    return {node.input[0] for node in graph.node if node.op_type == "SplitToSequence" and node.input[0] in initializers}


def _attach_parameters(graph: onnx.GraphProto, weights: list[TensorProto]) -> None:
    names = {w.name for w in weights}
    used = {name for g in _graphs(graph) for node in g.node for name in node.input}
    inputs = [i for i in graph.input if i.name not in names]
    del graph.input[:]
    graph.input.extend(inputs)
    graph.initializer.extend(w for w in weights if w.name in used)


def _load_small_tensors(graph: onnx.GraphProto, base_dir: Path) -> None:
    """Constants that are not parameters (buffers, shape constants) are read in so folding can use them."""
    for init in graph.initializer:
        _read_inline(init, base_dir)


def _read_inline(tensor: TensorProto, base_dir: Path) -> None:
    """A tensor stored as external data gets its bytes back in the proto (and forgets where they were)."""
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    if uses_external_data(tensor):
        load_external_data_for_tensor(tensor, str(base_dir))
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]


def load_attribute_tensors(graph: onnx.GraphProto, base_dir: Path) -> None:
    """Constant-node tensors the exporter stored as external data (the legacy exporter does, above 2 GB)
    are read back inline: they are scales and shapes, and only initializers go to the data file."""
    for g in _graphs(graph):
        for node in g.node:
            for attribute in node.attribute:
                tensors = [attribute.t] if attribute.type == onnx.AttributeProto.TENSOR else list(attribute.tensors)
                for tensor in tensors:
                    _read_inline(tensor, base_dir)


_LIST_CONSTANTS = {
    "value_ints": (TensorProto.INT64, True), "value_floats": (TensorProto.FLOAT, True),
    "value_int": (TensorProto.INT64, False), "value_float": (TensorProto.FLOAT, False),
}


def _typed_constants(graph: onnx.GraphProto) -> None:
    """Constant(value_ints=[...]) -> Constant(value=<int64 tensor>): graphsurgeon turns an *empty* list
    into a float64 tensor (an Expand with an empty double shape, which ONNX Runtime rejects)."""
    for g in _graphs(graph):
        for node in g.node:
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
                continue
            attribute = node.attribute[0]
            if attribute.name not in _LIST_CONSTANTS:
                continue
            dtype, is_list = _LIST_CONSTANTS[attribute.name]
            value = helper.get_attribute_value(attribute)
            values = list(value) if is_list else [value]
            tensor = helper.make_tensor(node.output[0], dtype, [len(values)] if is_list else [], values)
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", tensor))


def _explicit_shape_slices(graph: onnx.GraphProto) -> None:
    """Shape(x, start=a, end=b) -> Slice(Shape(x), [a], [b], [0]): the same values, in a form graphsurgeon's
    shape folding does not get wrong (see the module docstring)."""
    nodes = []
    for node in graph.node:
        bounds = {a.name: a.i for a in node.attribute if a.name in ("start", "end")}
        if node.op_type != "Shape" or not bounds:
            nodes.append(node)
            continue
        whole = f"{node.output[0]}__whole_shape"
        starts, ends, axes = (f"{node.output[0]}__{name}" for name in ("starts", "ends", "axes"))
        nodes.append(helper.make_node("Shape", [node.input[0]], [whole], name=f"{node.name}__whole"))
        for name, value in ((starts, bounds.get("start", 0)), (ends, bounds.get("end", 2**62)), (axes, 0)):
            nodes.append(helper.make_node("Constant", [], [name], name=f"{name}__const",
                                          value=helper.make_tensor(name, TensorProto.INT64, [1], [value])))
        nodes.append(helper.make_node("Slice", [whole, starts, ends, axes], list(node.output), name=node.name))
    del graph.node[:]
    graph.node.extend(nodes)


def _fold_and_clean(model: onnx.ModelProto, label: str) -> None:
    """Fold constants, drop dead nodes, sort. graphsurgeon's shape-tensor cast elision can leave a
    mistyped node (T5's relative-position buckets: Mul(float, int64)); a strictly type-checked result
    is required, else folding retries without shape folding, and finally is skipped."""
    import onnx_graphsurgeon as gs
    import onnxruntime

    # graphsurgeon evaluates constant subgraphs with ONNX Runtime; both warn about folds we can do without
    gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR
    onnxruntime.set_default_logger_severity(3)
    for fold_shapes in (True, False, None):
        graph = gs.import_onnx(model)
        if fold_shapes is not None:
            try:
                graph.fold_constants(fold_shapes=fold_shapes, error_ok=True)
            except Exception as exc:  # noqa: BLE001 - folding is an optimisation: a graph it cannot fold is still correct
                log.warning("%s: constant folding failed (%s)", label, exc)
                continue
        candidate = gs.export_onnx(graph.cleanup(remove_unused_graph_inputs=False).toposort())
        try:
            onnx.shape_inference.infer_shapes(candidate, check_type=True, strict_mode=True)
        except Exception as exc:  # noqa: BLE001 - any checker error means this fold is unusable: try the next
            log.info("%s: folding with fold_shapes=%s gives an ill-typed graph (%s); retrying", label, fold_shapes,
                     str(exc).splitlines()[0])
            continue
        model.CopyFrom(candidate)
        return
    log.warning("%s: graph left unfolded", label)


# --- external data ------------------------------------------------------------------------------


def _external_location(tensor: TensorProto, source_dir: Path) -> tuple[str, int, int]:
    """(file, offset, length); without a length the tensor runs to the end of its file (the legacy
    exporter's one file per tensor)."""
    fields = {entry.key: entry.value for entry in tensor.external_data}
    location, offset = fields["location"], int(fields.get("offset", 0))
    if "length" in fields:
        return location, offset, int(fields["length"])
    return location, offset, (source_dir / location).stat().st_size - offset


def _set_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def write_external_data(graph: onnx.GraphProto, source_dir: Path, data_path: Path, data_name: str) -> int:
    """Copy each large tensor's bytes (from the raw export's data file, or inline) into `data_path`."""
    from onnx.external_data_helper import uses_external_data

    sources: dict[str, object] = {}
    try:
        with open(data_path, "wb") as out:
            for tensor in graph.initializer:
                if uses_external_data(tensor):
                    location, offset, length = _external_location(tensor, source_dir)
                    handle = sources.get(location) or sources.setdefault(location, open(source_dir / location, "rb"))
                    position = _aligned(out, length)
                    handle.seek(offset)
                    _copy(handle, out, length)
                elif tensor.HasField("raw_data") and len(tensor.raw_data) >= INLINE_LIMIT:
                    length = len(tensor.raw_data)
                    position = _aligned(out, length)
                    out.write(tensor.raw_data)
                    tensor.ClearField("raw_data")
                else:
                    continue
                _set_external(tensor, data_name, position, length)
            return out.tell()
    finally:
        for handle in sources.values():
            handle.close()


def _aligned(out, length: int) -> int:
    position = out.tell()
    if length >= ALIGN_THRESHOLD and position % ALIGNMENT:
        out.write(b"\0" * (ALIGNMENT - position % ALIGNMENT))
    return out.tell()


def _copy(source, target, length: int, chunk: int = 16 << 20) -> None:
    remaining = length
    while remaining:
        block = source.read(min(chunk, remaining))
        if not block:
            raise ExportError(f"the exporter's data file ended early ({remaining} bytes missing)")
        target.write(block)
        remaining -= len(block)
