"""The refit base for the onnxruntime target: the same ONNX with every initializer in external data.

onnxruntime applies `SessionOptions.add_initializer` overrides only after its graph optimizations, which
have by then folded the original values into new constants (the Transpose in front of a dynamo MatMul,
the Unsqueeze of a norm weight) or reordered them (NCHWc Conv weights): such overrides are silently
lost. `add_external_initializers` replaces external-data initializers before optimization, so every
weight can be refitted, but only weights stored as external data. This rewrite puts them all there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx

from ..errors import RefitError
from .onnx_graph import FLOAT_TYPES, load_structure
from .quantized_refit import promote_weight_scales


def externalize_weights(onnx_path: str | Path, out_path: str | Path) -> Path:
    """Write `out_path` (+ `<name>.data` beside it) holding every floating-point initializer as external data.

    Same graph, same values: only where the bytes live changes (and weight-quantizer scales written as
    Constant nodes become initializers). Integer constants (shapes, axes) stay inline, where onnxruntime's
    shape inference needs them; float8 weights go to the data file. Written to a temporary folder and moved
    into place, so an interrupted run leaves no half model.
    """
    from onnx.external_data_helper import convert_model_to_external_data

    source, target = Path(onnx_path), Path(out_path)
    if source.resolve() == target.resolve():
        raise RefitError(f"externalize_weights: write to another path than the source ({source})")
    load_structure(source)  # a clear error for a missing or corrupt file
    model = onnx.load(str(source))
    # a Q/DQ graph's weight scales become initializers too: an fp8/int8 refit rewrites them with the weights
    promote_weight_scales(model)
    data_name = target.name + ".data"
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location=data_name, size_threshold=0,
                                   convert_attribute=False)
    for tensor in model.graph.initializer:
        if tensor.data_type not in FLOAT_TYPES and tensor.data_type != onnx.TensorProto.FLOAT8E4M3FN:
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        onnx.save_model(model, str(staging / target.name))
        os.replace(staging / data_name, target.parent / data_name)
        os.replace(staging / target.name, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def inline_initializers(onnx_path: str | Path, names: list[str] | None = None) -> list[str]:
    """Initializers (of `names`, or all) stored inside the .onnx file: the ones a refit cannot replace."""
    model = load_structure(onnx_path)
    wanted = None if names is None else set(names)
    return sorted(
        t.name for t in model.graph.initializer
        if (wanted is None or t.name in wanted) and t.data_location != onnx.TensorProto.EXTERNAL
    )

