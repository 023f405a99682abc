"""Q/DQ over fp16 or bf16: the graph an fp8/int8 TensorRT engine is built from.

A strongly typed engine runs every tensor in the type the graph gives it. The quantize stage writes its
Q/DQ ONNX over the fp32 graph (what the onnxruntime target runs), so built as it is, every layer TensorRT
leaves unquantized (normalizations, softmax, the layers the quantize stage excluded) would run in fp32/TF32.
This pass makes the float parts the family's Q/DQ base (`config.qdq_base_precision`: fp16 for the UNet
families, bf16 for the DiTs, whose activations exceed fp16's range) while the I/O stays fp32: float32
weights, Q/DQ scales, Constant values and Cast targets become the base type (DequantizeLinear then yields it,
as its scale's type decides), and casts at the graph inputs and outputs keep the engine's contract.

Q/DQ scales. A weight's DequantizeLinear (its codes a constant) keeps its fp32 scale: DequantizeLinear-19 takes
any float scale over integer/float8 codes and yields the scale's type, so the weight comes out exact in fp32 and a
Cast gives the base type to its consumer. Lowered, an fp16 scale below 6.1e-5 (common for int8 weights of small
magnitude) would become subnormal or zero, and a bf16 scale loses up to 0.4 % of every weight of its channel.
An activation's QuantizeLinear must have its scale in the type of its input (opset 19), so activation scales are
lowered; its Q and DQ share that one lowered value, so the grid stays consistent: the effect is a calibration
amax changed by at most 2^-11 (fp16) or 2^-8 (bf16) relative, never a mismatch between Q and DQ. An fp16
activation scale is kept at or above fp16's smallest normal (2^-14) so it never rounds to zero (a zero scale
divides by zero in Q).

What the project's fp16 export keeps in fp32 stays fp32 here too (`fp32_islands.py`: sinusoidal timestep /
time-id / rotary embeddings, RMSNorm variances), with casts where an island meets the rest. Pure ONNX.
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
from ...onnx_facts import onnx_sha256
from ...precision import Precision
from .fp32_islands import constant_names, fp32_island_nodes, tensor_types

FLOAT: int = onnx.TensorProto.FLOAT
FLOAT16: int = onnx.TensorProto.FLOAT16
BFLOAT16: int = onnx.TensorProto.BFLOAT16
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14  # smaller fp16 values are subnormal (fewer significant bits) or zero
MIN_OPSET = 19  # QuantizeLinear/DequantizeLinear take float16/bfloat16 scales from opset 19 on
# (op_type, input index) that the ONNX standard keeps float32 whatever the graph's precision
FLOAT32_INPUTS = frozenset({("Resize", 2), ("Upsample", 1)})
BASES: dict[str, int] = {Precision.fp16: FLOAT16, Precision.bf16: BFLOAT16}
PASS_VERSION = "qdq-base-v3"  # v2: fp32 islands kept; bf16 bases; v3: weight DQ scales stay fp32


def _lowered(tensor: onnx.TensorProto, base_dir: str, low: int, scale: bool = False) -> onnx.TensorProto:
    """`tensor` in the low type; `scale`: a Q/DQ scale (positive), kept at or above fp16's smallest normal."""
    array = numpy_helper.to_array(tensor, base_dir=base_dir)
    if low == FLOAT16:
        if scale:
            array = np.maximum(array, FP16_MIN_NORMAL)
        return numpy_helper.from_array(np.clip(array, -FP16_MAX, FP16_MAX).astype(np.float16), tensor.name)
    import ml_dtypes

    return numpy_helper.from_array(array.astype(ml_dtypes.bfloat16), tensor.name)


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


class _Casts:
    """Cast nodes made on demand, each once per (tensor, type), emitted just before their first consumer."""

    def __init__(self) -> None:
        self.made: dict[tuple[str, int], str] = {}
        self.pending: list[onnx.NodeProto] = []

    def of(self, name: str, to: int) -> str:
        key = (name, to)
        if key not in self.made:
            suffix = {FLOAT: Precision.fp32, FLOAT16: Precision.fp16, BFLOAT16: Precision.bf16}[to]
            self.made[key] = f"{name}__{suffix}"
            self.pending.append(helper.make_node("Cast", [name], [self.made[key]], to=to,
                                                 name=f"{name}__{suffix}_cast"))
        return self.made[key]

    def flush(self) -> list[onnx.NodeProto]:
        out, self.pending = self.pending, []
        return out


def qdq_over_precision(model: onnx.ModelProto, precision: str = Precision.fp16, base_dir: str | Path = "") -> onnx.ModelProto:
    """The model with its float32 compute made `precision` (fp16 | bf16) but for its fp32 islands, fp32 I/O
    kept (in place; returned)."""
    if precision not in BASES:
        raise BuildError(f"a Q/DQ base is fp16 or bf16, not {precision!r}")
    if _default_opset(model) < MIN_OPSET:
        raise BuildError(f"a Q/DQ graph over {precision} needs opset {MIN_OPSET} or newer ({precision} scales); this "
                         f"one has opset {_default_opset(model)}: quantize with `opset: {MIN_OPSET}` or newer")
    low, graph, base = BASES[precision], model.graph, str(base_dir)
    types = tensor_types(model)
    island = fp32_island_nodes(model, types)
    constants = constant_names(graph)
    consumers: dict[str, set[int]] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, set()).add(index)
    keep32 = {node.input[i] for node in graph.node for op, i in FLOAT32_INPUTS
              if node.op_type == op and len(node.input) > i}
    # constants read only by island nodes stay fp32 (the sinusoid's frequencies, the eps, the exponent 2)
    island_constants = {name for name in constants if consumers.get(name) and consumers[name] <= island}
    fp32 = ({out for i in island for out in graph.node[i].output if types.get(out) == FLOAT}
            | {v.name for v in graph.input if types.get(v.name) == FLOAT} | island_constants | keep32)
    # a weight's DequantizeLinear (codes from a constant): its scale and its output stay fp32 (exact weights)
    initializers = {t.name for t in graph.initializer} | constants
    weight_dq = {index for index, node in enumerate(graph.node)
                 if node.op_type == "DequantizeLinear" and node.input and node.input[0] in initializers
                 and len(node.input) > 1 and types.get(node.input[1]) == FLOAT}
    fp32 |= {name for i in weight_dq for name in (graph.node[i].input[1], graph.node[i].output[0])}
    scales = {node.input[1] for node in graph.node
              if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 1}

    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == FLOAT and tensor.name not in fp32:
            graph.initializer[index].CopyFrom(_lowered(tensor, base, low, scale=tensor.name in scales))
    for index, node in enumerate(graph.node):
        if index in island:
            continue
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == FLOAT:
                attribute.i = low
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == FLOAT:
                if not any(out in fp32 for out in node.output):
                    attribute.t.CopyFrom(_lowered(attribute.t, base, low, scale=any(o in scales for o in node.output)))

    # float outputs computed in the low type: the producer writes `<name>__<low>`, a Cast gives the fp32 output
    suffix = {FLOAT16: Precision.fp16, BFLOAT16: Precision.bf16}[low]
    output_casts: list[onnx.NodeProto] = []
    for value in graph.output:
        if types.get(value.name, value.type.tensor_type.elem_type) == FLOAT and value.name not in fp32:
            lowered = f"{value.name}__{suffix}"
            for node in graph.node:
                node.output[:] = [lowered if name == value.name else name for name in node.output]
                node.input[:] = [lowered if name == value.name else name for name in node.input]
            types[lowered] = FLOAT
            output_casts.append(helper.make_node("Cast", [lowered], [value.name], to=FLOAT, name=value.name + "_cast"))

    casts, nodes = _Casts(), []
    for index, node in enumerate(graph.node):
        for position, name in enumerate(node.input):
            if not name or types.get(name) != FLOAT:
                continue
            if index in island and name not in fp32:
                node.input[position] = casts.of(name, FLOAT)
            elif (index not in island and name in fp32 and (node.op_type, position) not in FLOAT32_INPUTS
                  and not (index in weight_dq and position == 1)):
                node.input[position] = casts.of(name, low)
        nodes += [*casts.flush(), node]
    del graph.node[:]
    graph.node.extend([*nodes, *output_casts])
    del graph.value_info[:]  # stale float32 types; TensorRT and ONNX Runtime infer them
    return model


def qdq_over_fp16(model: onnx.ModelProto, base_dir: str | Path = "") -> onnx.ModelProto:
    """`qdq_over_precision(model, "fp16")`: the UNet families' Q/DQ base."""
    return qdq_over_precision(model, Precision.fp16, base_dir)


def _digest(onnx_path: Path, precision: str) -> str:
    return hashlib.sha256(f"{PASS_VERSION}:{precision}:{onnx_sha256(onnx_path)}".encode()).hexdigest()[:16]


def qdq_base_onnx(onnx_path: str | Path, cache_dir: str | Path, precision: str = Precision.fp16) -> Path:
    """`<cache_dir>/<key>/model.onnx`: the Q/DQ-over-`precision` form of a quantized ONNX, made once per source
    and base (keyed on its content hash and this pass's version) and committed by renaming a finished folder,
    so a half-written one is never used."""
    onnx_path, cache_dir = Path(onnx_path), Path(cache_dir)
    folder = cache_dir / _digest(onnx_path, precision)
    converted = folder / "model.onnx"
    if converted.is_file():
        return converted
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache_dir))
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
        qdq_over_precision(model, precision, onnx_path.parent)
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


def qdq_fp16_onnx(onnx_path: str | Path, cache_dir: str | Path) -> Path:
    return qdq_base_onnx(onnx_path, cache_dir, Precision.fp16)
