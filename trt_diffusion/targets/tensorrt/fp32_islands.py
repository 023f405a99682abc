"""Where a Q/DQ graph over fp16/bf16 keeps float32: the parts diffusers computes in fp32 under `.half()`.

The quantize stage's Q/DQ ONNX is exported from the fp32 module, so nothing in it marks the fp32 parts the
project's own fp16 export keeps (diffusers casts them explicitly). Lowering every float to fp16 would compute
them in fp16 (#27 item 1). Two kinds of island are found by the graph's structure, as pure ONNX:

- sinusoidal embeddings: the timestep / SDXL `time_ids` / FLUX guidance and rotary projections. Everything
  computed by elementwise and data-movement ops from a float graph input or a `Cast(to=FLOAT)` that ends in or
  passes through a `Sin`/`Cos` (arguments up to ~1000 where fp16's spacing is 0.5; diffusers'
  `get_timestep_embedding` and `get_1d_rotary_pos_embed` run in fp32 or fp64). It ends at the first weighted
  op (the embedding's linear) or where it meets an fp16 activation, which then gets a cast.
- the variance of RMSNorm and of decomposed LayerNorms: `ReduceMean(Pow(x, 2))` or `ReduceMean(Mul(x, x))`
  through `Add(eps)`, `Sqrt`, `Reciprocal` to the `Div`/`Mul` that normalises `x` (x² overflows fp16 above 256;
  diffusers' RMSNorm computes `x.float().pow(2).mean()` and `x * rsqrt(variance)` in fp32).

A float `Range` stays fp32 wherever it is (ONNX defines no float16/bfloat16 Range). What these do not cover,
said plainly: softmax stays in the low precision (TensorRT's fused attention
accumulates in fp32; SD 2.x `upcast_attention` has no trace in an fp32 graph), and ONNX `LayerNormalization` /
`RMSNormalization` nodes compute their statistics in fp32 by their own `stash_type`.
"""

from __future__ import annotations

from collections import defaultdict

import onnx

FLOAT = onnx.TensorProto.FLOAT
# elementwise and data-movement ops a sinusoidal embedding is computed with (no weights, no reductions)
SINUSOID_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Sin", "Cos", "Concat",
    "Unsqueeze", "Squeeze", "Reshape", "Expand", "Slice", "Gather", "Transpose", "Flatten", "Cast", "Identity",
    "Where", "Tile", "Split", "Max", "Min", "Clip", "Abs", "Floor", "Ceil", "Round", "Range", "ConstantOfShape",
})
VARIANCE_CHAIN_OPS = frozenset({"Add", "Sqrt", "Reciprocal"})
MAX_VARIANCE_CHAIN = 6


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor ONNX shape inference can type (external data is not needed)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - an uninferable graph: the types the model itself declares
        inferred = model
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
    types.update({t.name: t.data_type for t in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = attribute.t.data_type
    return {name: kind for name, kind in types.items() if kind}


def constant_names(graph: onnx.GraphProto) -> set[str]:
    return {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None


def _sinusoid_islands(graph: onnx.GraphProto, types: dict[str, int], constants: set[str]) -> set[int]:
    seeds = {v.name for v in graph.input if types.get(v.name) == FLOAT}
    reach: set[str] = set(seeds)
    reached: dict[int, onnx.NodeProto] = {}
    for index, node in enumerate(graph.node):
        if node.op_type not in SINUSOID_OPS:
            continue
        if _cast_to(node) == FLOAT:  # int -> float (timestep, position ids) starts an fp32 computation
            reach.update(node.output)
            reached[index] = node
            continue
        inputs = [name for name in node.input if name]
        if any(name not in types for name in inputs):
            continue  # untyped: never guessed into an island
        live = [n for n in inputs if types[n] == FLOAT and n not in constants]
        makes_float = any(types.get(out) == FLOAT for out in node.output)
        # reached: every live float input is; or a float computed from constants alone (`arange`'s frequencies)
        if (live and all(n in reach for n in live)) or (not live and makes_float and all(
                n in reach or n in constants or types[n] != FLOAT for n in inputs)):
            reach.update(out for out in node.output if types.get(out) == FLOAT)
            reached[index] = node
    producer = {out: i for i, node in reached.items() for out in node.output}
    consumers: dict[str, list[int]] = defaultdict(list)
    for i, node in reached.items():
        for name in node.input:
            consumers[name].append(i)
    trig = [i for i, node in reached.items() if node.op_type in ("Sin", "Cos")]
    island: set[int] = set(trig)
    stack = list(trig)
    while stack:  # ancestors inside the reached part
        for name in reached[stack.pop()].input:
            source = producer.get(name)
            if source is not None and source not in island:
                island.add(source)
                stack.append(source)
    stack = list(trig)
    while stack:  # descendants inside it
        for name in reached[stack.pop()].output:
            for i in consumers.get(name, ()):
                if i not in island:
                    island.add(i)
                    stack.append(i)
    return island


def _variance_islands(graph: onnx.GraphProto, constants: set[str]) -> set[int]:
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    consumers: dict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(graph.node):
        for name in node.input:
            consumers[name].append(i)
    island: set[int] = set()
    for index, node in enumerate(graph.node):
        if node.op_type != "ReduceMean" or node.input[0] not in producer:
            continue
        square_index = producer[node.input[0]]
        square = graph.node[square_index]
        if square.op_type == "Pow" and square.input[1] in constants:
            x = square.input[0]
        elif square.op_type == "Mul" and square.input[0] == square.input[1]:
            x = square.input[0]
        else:
            continue
        chain = {square_index, index}
        current = node.output[0]
        for _ in range(MAX_VARIANCE_CHAIN):
            following = consumers.get(current, [])
            if len(following) != 1:
                break
            nxt = graph.node[following[0]]
            others = [n for n in nxt.input if n and n != current]
            if nxt.op_type in VARIANCE_CHAIN_OPS and all(n in constants for n in others):
                chain.add(following[0])
                current = nxt.output[0]
            elif nxt.op_type == "Div" and nxt.input[1] == current and nxt.input[0] in constants:  # 1 / std
                chain.add(following[0])
                current = nxt.output[0]
            elif nxt.op_type in ("Div", "Mul") and x in nxt.input:  # x / std, x * rsqrt: the island ends here
                chain.add(following[0])
                island |= chain
                break
            else:
                break
    return island


def fp32_island_nodes(model: onnx.ModelProto, types: dict[str, int] | None = None) -> set[int]:
    """Indices (into `model.graph.node`) of the nodes that keep computing in float32."""
    graph = model.graph
    types = tensor_types(model) if types is None else types
    constants = constant_names(graph)
    # ONNX's Range has no float16/bfloat16 form: a float Range stays fp32 wherever it is
    ranges = {i for i, node in enumerate(graph.node) if node.op_type == "Range" and types.get(node.output[0]) == FLOAT}
    return _sinusoid_islands(graph, types, constants) | _variance_islands(graph, constants) | ranges
