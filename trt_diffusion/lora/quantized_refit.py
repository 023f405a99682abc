"""LoRA refit of fp8/int8 (Q/DQ) engines without recalibration.

In the quantize stage's Q/DQ graph every quantized weight reaches its Conv/MatMul through a weight quantizer:

- int8: the fp32 initializer -> QuantizeLinear(scale, int8 zero point, axis 0) -> DequantizeLinear: the weight
  stays float, its per-output-channel scale is `amax / 127` of that very weight (ModelOpt's `max` on weights);
- fp8: a float8e4m3fn initializer (the fp32 weight quantized offline by `quantize/fp8_rewrite.py`) ->
  DequantizeLinear(scale): one scale per tensor, `amax / 448`.

A weight's scale is a function of the weight alone, so a refit writes the LoRA'd weight *and* its recomputed
scale (and, for fp8, the weight quantized with it), while every activation scale stays the calibrated one.
With SmoothQuant the stored weight is `W / s` (`s`: the layer's `pre_quant_scale`, applied to its input by a
Mul in the graph): the fused weight is smoothed by the same `s` before its scale is taken, which keeps the
product `x*s @ (W/s)^T` exact while the activation ranges stay calibrated for the base model.

`annotate_quantized` adds this to a refit map (built on the graph the engine runs); `quantized_arrays` turns a
fused fp32 weight into the initializers to write. `promote_weight_scales` makes the scales, which the legacy
exporter writes as Constant nodes, initializers: ONNX Runtime's `add_external_initializers` replaces only
initializers (TensorRT refits a Constant node's value by its output name too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import RefitError
from ..onnx_facts import FP8_MAX, to_fp8
from ..precision import Precision
from .onnx_graph import graph_consumers
from .refit_records import MatchedBy, RefitTarget, WeightQuantization

INT8_MAX = 127.0
FLOAT8 = onnx.TensorProto.FLOAT8E4M3FN
_WEIGHT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
_LAYOUT_OPS = ("Transpose", "Reshape", "Cast", "Identity")


# ----------------------------------------------------------------------------------------------
# Scales: what ModelOpt's weight quantizers compute (`max` calibration of the weight itself)
# ----------------------------------------------------------------------------------------------


def int8_scale(weight: np.ndarray, axis: int | None) -> np.ndarray:
    """ModelOpt's int8 export: amax (per `axis`, or of the tensor) / 127 in float32, a zero scale made 1."""
    weight = np.asarray(weight, dtype=np.float32)
    if axis is None:
        amax = np.abs(weight).max(keepdims=False).astype(np.float32)
    else:
        amax = np.abs(np.moveaxis(weight, axis, 0)).reshape(weight.shape[axis], -1).max(axis=1)
    amax = np.maximum(amax, np.finfo(np.float32).tiny).astype(np.float32)
    scale = (amax / np.float32(INT8_MAX)).astype(np.float32)
    return np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)


def fp8_scale(weight: np.ndarray) -> np.float32:
    """amax / 448 of the whole tensor (FP8 weights are quantized per tensor)."""
    amax = max(float(np.abs(np.asarray(weight, dtype=np.float32)).max()), float(np.finfo(np.float32).tiny))
    return np.float32(amax / FP8_MAX)


def quantized_arrays(target, value: np.ndarray) -> dict[str, np.ndarray]:
    """The initializers one fused weight becomes: the weight as stored (smoothed, in the stored layout; float8
    for fp8) and its recomputed scale. `target` is the weight's RefitTarget; `value` the fused fp32 weight in
    torch layout."""
    quant: WeightQuantization = target.quantization
    weight = np.asarray(value, dtype=np.float32)
    if quant.smoothing is not None:
        smoothing = np.asarray(quant.smoothing, dtype=np.float32)
        if weight.ndim < 2 or weight.shape[1] != smoothing.size:
            raise RefitError(f"{target.initializer}: SmoothQuant scale of {smoothing.size} values does not fit a "
                             f"weight of shape {weight.shape}")
        weight = weight / smoothing.reshape((1, -1) + (1,) * (weight.ndim - 2))
    if target.transpose:
        weight = weight.T
    weight = np.ascontiguousarray(weight.reshape(target.shape), dtype=np.float32)
    if quant.kind == Precision.int8:
        scale = int8_scale(weight, quant.axis)
        return {target.initializer: weight, quant.scale: scale.reshape(quant.scale_shape)}
    if quant.kind == Precision.fp8:
        scale = fp8_scale(weight)
        return {target.initializer: to_fp8(weight, scale),
                quant.scale: np.full(quant.scale_shape, scale, dtype=np.float32)}
    raise RefitError(f"{target.initializer}: unknown weight quantization {quant.kind!r}; rebuild the refit map")


# ----------------------------------------------------------------------------------------------
# The graph: weight quantizers, and their scales as initializers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Quantizer:
    kind: str
    stored: str  # the initializer holding the weight (fp32 for int8, float8 for fp8)
    scale: str
    axis: int | None
    consumer: onnx.NodeProto | None  # the Conv/MatMul/Gemm reading the dequantized weight


def _attribute(node: onnx.NodeProto, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def _weight_consumer(name: str, consumers) -> onnx.NodeProto | None:
    for _ in range(4):
        readers = consumers.get(name, [])
        if len(readers) != 1:
            return None
        node = readers[0]
        if node.op_type in _WEIGHT_OPS:
            return node if list(node.input).index(name) == 1 else None
        if node.op_type not in _LAYOUT_OPS:
            return None
        name = node.output[0]
    return None


def weight_quantizers(graph: onnx.GraphProto) -> list[_Quantizer]:
    """Every weight quantizer of a Q/DQ graph: a DequantizeLinear reading a float8 initializer, or reading a
    QuantizeLinear of a float initializer."""
    initializers = {t.name: t for t in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    consumers = graph_consumers(graph)
    found = []
    for node in graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        source = node.input[0]
        if source in initializers and initializers[source].data_type == FLOAT8:
            kind, stored = Precision.fp8, source
        elif source in producers and producers[source].op_type == "QuantizeLinear" \
                and producers[source].input[0] in initializers:
            quantize = producers[source]
            if quantize.input[1] != node.input[1]:
                continue  # Q and DQ with different scale tensors: not what the quantize stage writes
            kind, stored = Precision.int8, quantize.input[0]
            zero_point = quantize.input[2] if len(quantize.input) > 2 else ""
            if zero_point and zero_point in initializers and initializers[zero_point].data_type == FLOAT8:
                kind = "fp8-unfolded"
        else:
            continue
        found.append(_Quantizer(kind, stored, node.input[1], _attribute(node, "axis", 1),
                                _weight_consumer(node.output[0], consumers)))
    return found


def promote_weight_scales(model: onnx.ModelProto) -> int:
    """Turn the Constant nodes that hold weight-quantizer scales into initializers of the same name (the graph
    computes the same values). Returns how many were promoted; 0 for a graph without Q/DQ."""
    graph = model.graph
    wanted = {q.scale for q in weight_quantizers(graph)}
    promoted = []
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] in wanted:
            value = next((a for a in node.attribute if a.name == "value"), None)
            if value is None:
                continue
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value.t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
            promoted.append(node)
    for node in promoted:
        graph.node.remove(node)
    return len(promoted)


def _smoothing(graph, consumer: onnx.NodeProto | None, initializers, producers) -> np.ndarray | None:
    """SmoothQuant's pre_quant_scale of the layer: the Mul by an initializer in front of its input quantizer."""
    if consumer is None:
        return None
    name = consumer.input[0]
    for _ in range(4):
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type == "Mul":
            constant = next((i for i in node.input if i in initializers), None)
            if constant is not None and "pre_quant_scale" in constant:
                return graph.value(constant).astype(np.float32).reshape(-1)
            return None
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear", "Cast", "Identity"):
            return None
        name = node.input[0]
    return None


def annotate_quantized(graph, targets: dict, unmapped: dict, params: dict, prefix: str) -> None:
    """Add the weight quantization of every quantized weight to a refit map being built (in place).

    `graph`: the `OnnxGraph`; `targets`/`unmapped`: the builder's results; `params`: name -> `_Param` (shape,
    fp32 value or None); `prefix`: the initializers' constant prefix. int8 weights were mapped by name; fp8 and
    smoothed ones hold other values than the torch weights, so they are matched here by name and confirmed by
    value (the quantized or smoothed base weight) when values are known.
    """
    model_graph = graph.model.graph
    quantizers = weight_quantizers(model_graph)
    if not quantizers:
        return
    initializers = {t.name: t for t in model_graph.initializer}
    producers = {output: node for node in model_graph.node for output in node.output}
    constants = {node.output[0]: attribute.t for node in model_graph.node if node.op_type == "Constant"
                 for attribute in node.attribute if attribute.name == "value"}
    by_stored = {}
    for param, target in targets.items():
        by_stored.setdefault(target.initializer, []).append(param)
    for quantizer in quantizers:
        plain = quantizer.stored.removesuffix("_fp8") if quantizer.kind == Precision.fp8 else quantizer.stored
        plain = plain[len(prefix):] if prefix and plain.startswith(prefix) else plain
        candidates = [p for p in by_stored.get(quantizer.stored, []) if p in params] or \
                     ([plain] if plain in params else [])
        if len(candidates) != 1:
            continue  # no torch parameter of this model (or several): nothing to refit there
        param = candidates[0]
        # A quantized weight is refitted with its scale or not at all: writing the weight alone would keep
        # the base weight's range (clipping what the LoRA adds). What cannot be done is listed as unmapped.
        reason = None
        if quantizer.kind == "fp8-unfolded":
            reason = (f"{quantizer.stored} is an fp8 weight quantized inside the graph (not folded by the quantize "
                      "stage); re-export it with `trt-diffusion quantize`")
        elif quantizer.scale not in initializers and quantizer.scale not in constants:
            reason = f"the scale of its quantized weight {quantizer.stored} ({quantizer.scale}) is computed in the graph"
        if reason is not None:
            targets.pop(param, None)
            unmapped[param] = reason
            continue
        spec = params[param]
        # an initializer, or a Constant node (TensorRT refits those by output name; the onnxruntime refit base
        # makes them initializers, see promote_weight_scales)
        scale_tensor = initializers.get(quantizer.scale) or constants[quantizer.scale]
        scale_shape = tuple(int(d) for d in scale_tensor.dims)
        smoothing = _smoothing(graph, quantizer.consumer, initializers, producers)
        axis = quantizer.axis if np.prod(scale_shape) > 1 else None
        quant = WeightQuantization(quantizer.kind, quantizer.scale, axis, scale_shape,
                                   tuple(float(v) for v in smoothing) if smoothing is not None else None)
        stored_shape = graph.shape(quantizer.stored)
        transpose = len(spec.shape) == 2 and stored_shape == spec.shape[::-1] and stored_shape != spec.shape
        target = RefitTarget(initializer=quantizer.stored, transpose=transpose, shape=stored_shape,
                             dtype=graph.dtype(quantizer.stored).name,
                             matched_by=targets[param].matched_by if param in targets else MatchedBy.name,
                             quantization=quant)
        if spec.value is not None and not _confirms(graph, target, spec.value):
            unmapped[param] = (f"the quantized initializer {quantizer.stored} does not hold this weight quantized "
                               "(is this the model that was quantized?)")
            targets.pop(param, None)
            continue
        targets[param] = target
        unmapped.pop(param, None)


def _confirms(graph, target, base: np.ndarray) -> bool:
    """The stored initializer (and its scale) are what `quantized_arrays` makes of the base weight."""
    expected = quantized_arrays(target, base)
    stored = graph.value(target.initializer)
    if target.quantization.kind == Precision.fp8:
        # fp8 codes of the base weight; the scale may differ from ModelOpt's by one ulp (1/(448/amax) vs
        # amax/448), which moves a value across a rounding boundary rarely: allow one code in a thousand
        codes = expected[target.initializer].view(np.uint8) != stored.view(np.uint8)
        return float(codes.mean()) <= 1e-3
    if target.quantization.smoothing is None:
        return np.array_equal(stored, expected[target.initializer])
    return np.allclose(stored, expected[target.initializer], rtol=1e-5, atol=1e-7)
