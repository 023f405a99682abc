"""Precision: what an engine computes in. The one place that knows which precisions are quantized (fp8, int8:
a Q/DQ graph from ModelOpt, calibrated) and what a parameter costs in each; everything else asks it."""

from __future__ import annotations

from enum import Enum


class Precision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8 = "fp8"
    int8 = "int8"

    __str__ = str.__str__  # str() and f-strings give "fp16", as the plain strings did

    @property
    def is_quantized(self) -> bool:
        return self in (Precision.fp8, Precision.int8)

    @property
    def bytes_per_parameter(self) -> float:
        return {Precision.fp32: 4, Precision.fp16: 2, Precision.bf16: 2, Precision.fp8: 1, Precision.int8: 1}[self]


def is_quantized(precision: str) -> bool:
    """Whether a precision name (engines.yaml, a spec, a manifest) is one of the quantized ones."""
    return Precision(precision).is_quantized
