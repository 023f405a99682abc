"""Export a ModelOpt-quantized denoiser to ONNX with Q/DQ nodes.

The legacy TorchScript exporter is the one ModelOpt's quantizer symbolics target (dynamo fails on the
quantizers' data-dependent branches: `GuardOnDataDependentSymNode`), so this is the one place that uses `dynamo=False`.
What the legacy exporter cannot lower as the fp32 export does is handled here: `aten::rms_norm` gets an ONNX
decomposition (FLUX, Wan), and `trace_patches` rewrites Wan's rotary embedding so the graph stays dynamic.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx.external_data_helper import uses_external_data

from ..components import ExportWrapper
from ..errors import QuantizeError
from ..export.graph_passes import load_attribute_tensors, strip_prefix, write_external_data
from ..precision import Precision
from .feeds import DenoiserInterface
from .fp8_rewrite import MIN_OPSET as FP8_MIN_OPSET
from .fp8_rewrite import rewrite_fp8_qdq
from .trace_patches import trace_patches

LEGACY_MAX_OPSET = 21
LEGACY_MIN_OPSET = 17
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # protobuf cannot hold more than 2 GB in one message
WRAPPER_PREFIX = ExportWrapper.PARAMETER_PREFIX  # "model.": stripped, as the fp32 export does
STREAMED_WEIGHTS = "weights.data"  # a trace's parameters, written from the module (stream_weights)


def _rms_norm_symbolic(g, input, normalized_shape, weight, eps):
    """aten::rms_norm as ONNX ops (<= opset 21 has no RMSNormalization); FLUX's and Wan's norms need it.

    (So Wan needs no `torch.nn.RMSNorm.forward` patch.) ReduceMean takes its axes as an input from opset 18,
    as an attribute before."""
    from torch.onnx import symbolic_helper

    dims = symbolic_helper._get_const(normalized_shape, "is", "normalized_shape")
    eps_value = symbolic_helper._maybe_get_const(eps, "f")
    if eps_value is None or symbolic_helper._is_value(eps_value):
        eps_value = torch.finfo(torch.float32).eps  # torch's default for float32 inputs
    axes = list(range(-len(dims), 0))
    square = g.op("Mul", input, input)
    if g.opset >= 18:
        mean_square = g.op("ReduceMean", square, g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64)),
                           keepdims_i=1)
    else:
        mean_square = g.op("ReduceMean", square, axes_i=axes, keepdims_i=1)
    denominator = g.op("Sqrt", g.op("Add", mean_square, g.op("Constant", value_t=torch.tensor(float(eps_value)))))
    output = g.op("Div", input, denominator)
    if not symbolic_helper._is_none(weight):
        output = g.op("Mul", output, weight)
    return output


def _register_symbolics(opset: int) -> None:
    torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, opset)


def export_opset(requested: int, precision: str) -> int:
    """The opset the legacy exporter can write for `precision`: requested, clamped into what works."""
    opset = min(max(requested, LEGACY_MIN_OPSET), LEGACY_MAX_OPSET)
    if precision == Precision.fp8 and opset < FP8_MIN_OPSET:
        opset = FP8_MIN_OPSET
    return opset


@contextlib.contextmanager
def _fp8_conv_weights_off(module: torch.nn.Module, precision: str):
    """The legacy exporter cannot use a custom op's output as a Conv weight: turn FP8 Conv weight quantizers
    off for the trace and yield their ranges, so the rewrite pass adds the weight DequantizeLinear."""
    switched: dict[str, torch.nn.Module] = {}
    if precision == Precision.fp8:
        for name, layer in module.named_modules():
            quantizer = getattr(layer, "weight_quantizer", None)
            if isinstance(layer, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) and quantizer is not None \
                    and quantizer.is_enabled:
                switched[name] = quantizer
    amax = {f"{WRAPPER_PREFIX}{name}.weight": float(q.amax.detach().float().max()) for name, q in switched.items()}
    # only the layers the trace runs are in the graph: a step cache's piece runs a part of the denoiser's Convs
    called: set[str] = set()
    layers = dict(module.named_modules())
    hooks = [layers[name].register_forward_hook(lambda *_, name=name: called.add(name)) for name in switched]
    for quantizer in switched.values():
        quantizer.disable()
    try:
        yield amax
    finally:
        for hook in hooks:
            hook.remove()
        for quantizer in switched.values():
            quantizer.enable()
        for name in switched:
            if name not in called:
                del amax[f"{WRAPPER_PREFIX}{name}.weight"]


@dataclass(frozen=True)
class ExportSummary:
    op_counts: dict[str, int]

    def to_json(self) -> dict:
        return {"exporter": "torch.onnx legacy (dynamo=False)", "nodes": sum(self.op_counts.values()),
                "quantize_linear": self.op_counts.get("QuantizeLinear", 0),
                "dequantize_linear": self.op_counts.get("DequantizeLinear", 0)}


@dataclass(frozen=True)
class TracedGraph:
    """The exporter's raw output in a temporary folder: the graph, and its weights as the exporter wrote
    them (one file per tensor above 2 GB in all, inline below)."""

    path: Path
    conv_weight_amax: dict[str, float]  # FP8 Conv weights whose Q/DQ the rewrite adds (see _fp8_conv_weights_off)


@contextlib.contextmanager
def traced_quantized(module: torch.nn.Module, interface: DenoiserInterface, example: dict[str, torch.Tensor],
                     precision: str, opset: int, *, stream_weights: bool = False) -> Iterator[TracedGraph]:
    """Trace `module` (already calibrated) at `example`'s shapes with the declared dynamic axes (Wan: through
    `trace_patches`, which keeps its rotary embedding from fixing the shapes).

    Nothing of the trace stays in memory: the caller can free the module before `finalize_quantized`
    reads the graph back (a full-size model would otherwise be held twice, or three times). The folder is
    removed on leaving.

    `stream_weights`: trace without the parameters (they become graph inputs, nothing folded into them) and write
    them afterwards from the module, one tensor at a time. The legacy exporter otherwise holds the weights three
    times (the module, the Transposes it folds into new tensors, the serialized protobuf): 2.9x a language-model
    encoder's fp32 weights. The graph then keeps a Transpose before each MatMul, which every runtime folds at
    build; the denoisers keep the folded layout their quantized LoRA refit reads (lora/quantized_refit.py).
    """
    wrapper = interface.wrapper(module)
    inputs = tuple(example[name] for name in interface.input_names)
    tmp = Path(tempfile.mkdtemp(prefix="trt-diffusion-qexport-"))
    _register_symbolics(opset)
    try:
        try:
            with torch.inference_mode(), _fp8_conv_weights_off(module, precision) as conv_amax, _quiet_exporter(), \
                    trace_patches(module, interface.family):
                torch.onnx.export(
                    wrapper, inputs, str(tmp / "model.onnx"), input_names=interface.input_names,
                    output_names=interface.io.output_names, dynamic_axes=interface.dynamic_axes(),
                    opset_version=opset, dynamo=False, do_constant_folding=True, export_params=not stream_weights,
                )
                if stream_weights:
                    _parameters_as_initializers(tmp / "model.onnx", wrapper, set(interface.input_names))
        except Exception as exc:  # the exporter's errors are long; keep the first line and the cause
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise QuantizeError(f"ONNX export of {_label(interface)} failed: {first}") from exc
        del module, wrapper, inputs  # this frame lives until the caller leaves: it must not keep the module
        yield TracedGraph(tmp / "model.onnx", conv_amax)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _parameters_as_initializers(model_path: Path, wrapper: torch.nn.Module, declared: set[str]) -> None:
    """After a trace without parameters: each graph input that is a parameter of `wrapper` becomes an initializer,
    its bytes written beside the graph (`weights.data`) straight from the module, one tensor at a time."""
    from onnx.helper import np_dtype_to_tensor_dtype

    model = onnx.load(str(model_path), load_external_data=False)
    state = wrapper.state_dict(keep_vars=True)
    kept = []
    with open(model_path.parent / STREAMED_WEIGHTS, "wb") as out:
        for value in model.graph.input:
            if value.name in declared:
                kept.append(value)
                continue
            if value.name not in state:
                raise QuantizeError(f"the traced graph takes an input {value.name!r} that is neither declared nor a "
                                    "parameter of the module")
            array = np.ascontiguousarray(state[value.name].detach().cpu().numpy())
            tensor = onnx.TensorProto(name=value.name, dims=array.shape,
                                      data_type=np_dtype_to_tensor_dtype(array.dtype))
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, entry in (("location", STREAMED_WEIGHTS), ("offset", out.tell()), ("length", array.nbytes)):
                tensor.external_data.add(key=key, value=str(entry))
            out.write(memoryview(array).cast("B"))
            model.graph.initializer.append(tensor)
    del model.graph.input[:]
    model.graph.input.extend(kept)
    onnx.save_model(model, str(model_path))


def finalize_quantized(traced: TracedGraph, interface: DenoiserInterface, out_path: Path,
                       precision: str) -> ExportSummary:
    """Check the traced I/O, rewrite FP8 Q/DQ, give initializers their parameter names, write `out_path`.

    Only the graph skeleton is loaded: weights are read one at a time where a pass needs their values
    (the FP8 rewrite) and streamed file to file into `<name>.data`.
    """
    label = _label(interface)
    model = onnx.load(str(traced.path), load_external_data=False)
    load_attribute_tensors(model.graph, traced.path.parent)
    _keep_unused_inputs(model.graph, interface)
    _check_declared_io(model.graph, interface, label)
    if precision == Precision.fp8:
        rewrite_fp8_qdq(model, traced.conv_weight_amax, base_dir=traced.path.parent)
    strip_prefix(model.graph, WRAPPER_PREFIX)
    summary = ExportSummary(dict(Counter(node.op_type for node in model.graph.node)))
    save_model(model, out_path, traced.path.parent)
    return summary


def _label(interface: DenoiserInterface) -> str:
    return f"the quantized {interface.family.value} {getattr(interface, 'graph_name', interface.component.value)}"


def _keep_unused_inputs(graph: onnx.GraphProto, interface: DenoiserInterface) -> None:
    """Declared inputs the graph never reads, back as graph inputs, in the declared order.

    The legacy exporter drops an input nothing consumes: DeepCache's shallow graph at branch 0 of a UNet whose last up
    block has no cross-attention never reads encoder_hidden_states. The engines take the declared inputs whatever the
    graph reads (the fp32 export, by dynamo, keeps them)."""
    present = {value.name for value in graph.input}
    dtypes = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64}
    if all(decl.name in present for decl in interface.io.inputs):
        return
    declared = []
    for decl in interface.io.inputs:
        if decl.name in present:
            declared.append(next(v for v in graph.input if v.name == decl.name))
        else:
            declared.append(onnx.helper.make_tensor_value_info(decl.name, dtypes[decl.dtype], list(decl.dim_names())))
    others = [v for v in graph.input if v.name not in {d.name for d in interface.io.inputs}]
    del graph.input[:]
    graph.input.extend(declared + others)


def _check_declared_io(graph: onnx.GraphProto, interface: DenoiserInterface, label: str) -> None:
    """The traced graph has the declared names and sizes; dims the exporter left unknown get the declared ones.

    (The legacy exporter loses output shapes behind ModelOpt's custom FP8 ops.)
    """
    problems = []
    for declared, values in ((interface.io.inputs, graph.input), (interface.io.outputs, graph.output)):
        by_name = {v.name: v for v in values}
        for decl in declared:
            value = by_name.get(decl.name)
            if value is None:
                problems.append(f"{decl.name} is missing")
                continue
            shape = value.type.tensor_type.shape
            if len(shape.dim) != len(decl.dims):
                problems.append(f"{decl.name} has rank {len(shape.dim)}, declared {list(decl.dim_names())}")
                continue
            for dim, want in zip(shape.dim, decl.dims):
                if dim.HasField("dim_value"):
                    if isinstance(want, int) and dim.dim_value != want:
                        problems.append(f"{decl.name} is {[d.dim_value or d.dim_param for d in shape.dim]}, "
                                        f"declared {list(decl.dim_names())}")
                        break
                elif not dim.dim_param:
                    if isinstance(want, int):
                        dim.dim_value = want
                    else:
                        dim.dim_param = want.name
    if problems:
        raise QuantizeError(f"{label}: the traced graph does not match the component's declared I/O: "
                            + "; ".join(problems))


@contextlib.contextmanager
def _quiet_exporter():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def save_model(model: onnx.ModelProto, path: Path, source_dir: Path) -> None:
    """One .onnx file, plus one `<name>.data` file when weights are external (the exporter wrote them out) or
    would exceed protobuf's 2 GB limit inline; external tensors are copied from `source_dir`, one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if any(uses_external_data(t) for t in model.graph.initializer) or model.ByteSize() > EXTERNAL_DATA_THRESHOLD:
        data_name = f"{path.name}.data"
        write_external_data(model.graph, source_dir, path.parent / data_name, data_name)
    onnx.save_model(model, str(path))
    if not path.is_file() or os.path.getsize(path) == 0:
        raise QuantizeError(f"writing {path} failed")
