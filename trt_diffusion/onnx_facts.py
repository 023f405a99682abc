"""What every target needs to know about an exported ONNX, without any runtime: optimization profiles,
input shapes, Q/DQ detection, the content hash a build is keyed on, base weights, and the atomic writer.

Pure Python (numpy, onnx, pydantic); shared by the onnxruntime, tensorrt and openvino targets.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import BuildError, RefitError
from .tensors import TensorSpec
from .workspace.files import update_digest

if TYPE_CHECKING:  # onnx and numpy are imported where used: listing targets (plan, the CLI) needs neither
    import numpy as np
    import onnx

Shape = tuple[int, ...]
# input name -> (min, opt, max) shape of the engine's single optimization profile
ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]

QDQ_OP_TYPES = frozenset({"QuantizeLinear", "DequantizeLinear"})
TRT_CUSTOM_DOMAIN = "trt"  # ModelOpt's FP8 export emits trt::TRT_FP8QuantizeLinear / ...DequantizeLinear


# ----------------------------------------------------------------------------------------------
# Optimization profiles
# ----------------------------------------------------------------------------------------------


def _as_shape(value: Sequence[int], what: str) -> Shape:
    try:
        shape = tuple(int(d) for d in value)
    except (TypeError, ValueError) as err:
        raise BuildError(f"{what}: expected a sequence of integers, got {value!r}") from err
    return shape


def _profile_problems(name: str, min_shape: Shape, opt_shape: Shape, max_shape: Shape) -> list[str]:
    shown = f"(min {min_shape}, opt {opt_shape}, max {max_shape})"
    if not len(min_shape) == len(opt_shape) == len(max_shape):
        return [f"input '{name}': min, opt and max have different ranks {shown}"]
    problems = []
    for axis, (lo, mid, hi) in enumerate(zip(min_shape, opt_shape, max_shape)):
        if lo < 1:
            problems.append(f"input '{name}': dim {axis} has min {lo}; every dimension must be at least 1 {shown}")
        elif not lo <= mid <= hi:
            problems.append(f"input '{name}': dim {axis} needs min <= opt <= max, got {lo}, {mid}, {hi} {shown}")
    return problems


def validate_profile(shapes: Mapping[str, Sequence[Sequence[int]]]) -> ProfileShapes:
    """Check every input's (min, opt, max) and return them as tuples; BuildError lists every problem."""
    normalized: ProfileShapes = {}
    problems: list[str] = []
    for name, triple in shapes.items():
        if len(triple) != 3:
            problems.append(f"input '{name}': expected (min, opt, max) shapes, got {len(triple)} shapes")
            continue
        min_shape, opt_shape, max_shape = (_as_shape(s, f"input '{name}'") for s in triple)
        problems += _profile_problems(name, min_shape, opt_shape, max_shape)
        normalized[name] = (min_shape, opt_shape, max_shape)
    if problems:
        raise BuildError("invalid optimization profile:\n  " + "\n  ".join(problems))
    return normalized


def onnx_input_shapes(onnx_path: str | Path) -> dict[str, Shape]:
    """The ONNX graph's real inputs (initializers excluded), -1 for every symbolic or unknown dim."""
    model = load_onnx_structure(onnx_path)
    initializers = {init.name for init in model.graph.initializer}
    shapes: dict[str, Shape] = {}
    for value in model.graph.input:
        if value.name in initializers:  # IR < 4 lists initializers among the inputs
            continue
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in dims)
    return shapes


def check_profile_against_inputs(shapes: ProfileShapes, input_shapes: Mapping[str, Shape]) -> None:
    """The profile must name exactly the network's inputs, with their ranks and static dims.

    Checked before TensorRT parses anything, so a wrong profile fails fast with names rather than
    with TensorRT's "No valid profile found" deep in a build.
    """
    problems: list[str] = []
    unknown = sorted(set(shapes) - set(input_shapes))
    if unknown:
        problems.append(f"profile names input(s) the ONNX does not have: {unknown} (its inputs: {sorted(input_shapes)})")
    for name, declared in input_shapes.items():
        dynamic = any(d < 0 for d in declared)
        if name not in shapes:
            if dynamic:
                problems.append(f"input '{name}' has dynamic shape {declared} but no (min, opt, max) in the profile")
            continue
        for label, shape in zip(("min", "opt", "max"), shapes[name]):
            if len(shape) != len(declared):
                problems.append(f"input '{name}': {label} {shape} has rank {len(shape)}, the ONNX input {declared} has rank {len(declared)}")
                break
            fixed = [axis for axis, d in enumerate(declared) if d >= 0 and shape[axis] != d]
            if fixed:
                problems.append(f"input '{name}': {label} {shape} differs from the ONNX input's static dims {declared} at dim(s) {fixed}")
    if problems:
        raise BuildError("the optimization profile does not fit the ONNX inputs:\n  " + "\n  ".join(problems))



# ----------------------------------------------------------------------------------------------
# ONNX facts that decide the build
# ----------------------------------------------------------------------------------------------


def load_onnx_structure(onnx_path: str | Path, *, error: type[Exception] = BuildError) -> onnx.ModelProto:
    """The graph without its weights: cheap even for a multi-GB UNet. A missing or corrupt file is one `error`
    (BuildError for a build, RefitError for a refit)."""
    import onnx

    path = Path(onnx_path)
    if not path.is_file():
        raise error(f"ONNX file not found: {path}")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - protobuf raises several unrelated types on a corrupt file
        raise error(f"could not read ONNX file {path}: {err}") from None


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    import onnx

    for node in graph.node:
        yield node
        for attribute in node.attribute:  # If/Loop/Scan bodies
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _all_nodes(subgraph)


def _is_qdq_node(node: onnx.NodeProto) -> bool:
    if node.op_type in QDQ_OP_TYPES:
        return True
    return node.domain == TRT_CUSTOM_DOMAIN and ("QuantizeLinear" in node.op_type or "DequantizeLinear" in node.op_type)


def onnx_has_qdq(model_path: str | Path) -> bool:
    """True when the ONNX carries explicit quantization (standard Q/DQ or TensorRT-domain FP8 nodes)."""
    model = load_onnx_structure(model_path)
    nodes = list(_all_nodes(model.graph))
    for function in model.functions:
        nodes += function.node
    return any(_is_qdq_node(node) for node in nodes)


def _external_data_files(model: onnx.ModelProto) -> list[str]:
    import onnx

    locations = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(entry.value for entry in tensor.external_data if entry.key == "location")
    return sorted(locations)


def external_data_files(onnx_path: str | Path, *, error: type[Exception] = BuildError) -> list[str]:
    """The external-data file names (relative to its folder) an ONNX keeps its initializers in."""
    return _external_data_files(load_onnx_structure(onnx_path, error=error))


_DIGESTS_LOCK = threading.Lock()
_DIGESTS: dict[tuple, str] = {}


def _file_identity(path: Path) -> tuple:
    stat = path.stat()
    return (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev)


def onnx_sha256(onnx_path: str | Path, *, error: type[Exception] = BuildError) -> str:
    """Hash of the model file and every external-data file it references: the build's input identity, and the
    ONNX a refit map was made for. A missing or corrupt file is one `error` (BuildError, RefitError for a refit).

    Computed once per process for a given set of files (keyed on each file's path, size, mtime and inode),
    so a multi-GB ONNX that many engines are built from, or every refit checks, is read once per run.
    """
    path = Path(onnx_path)
    model = load_onnx_structure(path, error=error)
    files = [(None, path)]
    for location in _external_data_files(model):
        data_path = path.parent / location
        if not data_path.is_file():
            raise error(f"{path} references external data {location!r}, which is missing from {path.parent}")
        files.append((location, data_path))
    key = tuple((location, _file_identity(file)) for location, file in files)
    with _DIGESTS_LOCK:
        known = _DIGESTS.get(key)
    if known is not None:
        return known
    digest = hashlib.sha256()
    for location, file in files:
        if location is not None:
            digest.update(location.encode())
        update_digest(digest, file)
    value = digest.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[key] = value
    return value


_FLOAT_DTYPES = {"FLOAT": "float32", "FLOAT16": "float16", "BFLOAT16": "bfloat16", "DOUBLE": "float64"}


def _tensor_elements(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= int(dim)
    return count


def onnx_compute_dtype(onnx_path: str | Path) -> str | None:
    """The dtype of most float weights (by element count, initializers and Constant nodes): float32,
    float16 or bfloat16 for graphs exported at that precision; None for a graph without float weights.
    Read from the graph's structure only (external data is not loaded)."""
    import onnx

    model = load_onnx_structure(onnx_path)
    counts: dict[str, int] = {}
    tensors = list(model.graph.initializer)
    for node in _all_nodes(model.graph):
        if node.op_type == "Constant":
            tensors += [a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR]
    for tensor in tensors:
        name = _FLOAT_DTYPES.get(onnx.TensorProto.DataType.Name(tensor.data_type))
        if name is not None:
            counts[name] = counts.get(name, 0) + _tensor_elements(tensor)
    return max(counts, key=lambda n: counts[n]) if counts else None


def read_base_weights(onnx_path: str | Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """ONNX initializers by name (all floating-point ones when `names` is None): the weights a refit
    restores. Only the requested tensors are read from external data."""
    import onnx
    from onnx import numpy_helper

    path = Path(onnx_path)
    model = load_onnx_structure(path)
    by_name = {tensor.name: tensor for tensor in model.graph.initializer}
    if names is None:
        floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
        wanted = [name for name, tensor in by_name.items() if tensor.data_type in floating]
    else:
        wanted = list(dict.fromkeys(names))
        missing = [name for name in wanted if name not in by_name]
        if missing:
            raise RefitError(f"{path} has no initializer(s) named {missing}")
    return {name: numpy_helper.to_array(by_name[name], base_dir=str(path.parent)) for name in wanted}


_ONNX_DTYPES = {"FLOAT": "float32", "FLOAT16": "float16", "INT64": "int64", "INT32": "int32", "BOOL": "bool",
                "BFLOAT16": "bfloat16"}


def onnx_io(onnx_path: str | Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The graph's real inputs (initializers excluded) and outputs, -1 for every dynamic dim."""
    model = load_onnx_structure(onnx_path)

    def info(value) -> TensorSpec:
        tensor = value.type.tensor_type
        shape = tuple(d.dim_value if d.dim_value else -1 for d in tensor.shape.dim)
        import onnx

        dtype = _ONNX_DTYPES.get(onnx.TensorProto.DataType.Name(tensor.elem_type), "float32")
        return TensorSpec(name=value.name, dtype=dtype, shape=shape)

    initializers = {i.name for i in model.graph.initializer}
    inputs = tuple(info(v) for v in model.graph.input if v.name not in initializers)
    return inputs, tuple(info(v) for v in model.graph.output)


# float8 e4m3fn, as ONNX's QuantizeLinear(saturate=1) makes it: the largest finite value, round to nearest even.
FP8_MAX = 448.0


def to_fp8(values, scale: float):
    """Quantize like QuantizeLinear(saturate=1) to float8e4m3fn: values / scale, clamped to +-448 (the quantize
    stage's offline fold and the quantized refit both store weights this way)."""
    import ml_dtypes
    import numpy as np

    return np.clip(np.asarray(values, dtype=np.float32) / np.float32(scale), -FP8_MAX, FP8_MAX).astype(
        ml_dtypes.float8_e4m3fn)
