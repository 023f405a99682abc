"""The dtype names a manifest writes for TensorRT's data types, and numpy's dtype for each where numpy has one."""

from __future__ import annotations

import numpy as np

# TensorRT DataType member name -> the dtype name written in manifests (numpy's name where numpy has one)
TRT_DTYPE_NAMES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "UINT8": "uint8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "FP8": "float8e4m3",
    "INT4": "int4",
    "FP4": "float4e2m1",
    "E8M0": "float8e8m0",
}


def numpy_dtype_for(dtype_name: str) -> np.dtype | None:
    """numpy's dtype for a manifest dtype name (bfloat16 through ml_dtypes, which onnx brings);
    None where there is none (fp8, int4, fp4)."""
    if dtype_name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype_name)
    except TypeError:
        return None


def trt_dtype_name(trt_dtype: object) -> str:
    """The manifest's dtype name of a TensorRT `DataType` member."""
    name = str(getattr(trt_dtype, "name", trt_dtype))
    return TRT_DTYPE_NAMES.get(name, name.lower())
