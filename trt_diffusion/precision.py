"""Precision: what an engine computes in. The one place that knows which precisions are quantized (fp8, int8:
a Q/DQ graph from ModelOpt, calibrated), which float dtype the others compute in, and what a parameter costs in
each; everything else asks it. No module outside this one spells a precision as a string literal
(tests/test_layout.py): it names a member, `Precision.fp16`, or asks a question of one."""

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
        return self in QUANTIZED

    @property
    def float_dtype(self) -> str | None:
        """numpy's name of the float dtype this precision computes in (bfloat16 through ml_dtypes); None for the
        quantized ones, whose unquantized layers compute in a float precision the target chooses."""
        return _FLOAT_DTYPES.get(self)

    @property
    def bytes_per_parameter(self) -> float:
        return {Precision.fp32: 4, Precision.fp16: 2, Precision.bf16: 2, Precision.fp8: 1, Precision.int8: 1}[self]


PRECISIONS: tuple[Precision, ...] = tuple(Precision)  # in the order engines.yaml's docs list them
QUANTIZED: frozenset[Precision] = frozenset({Precision.fp8, Precision.int8})
_FLOAT_DTYPES: dict[str, str] = {Precision.fp32: "float32", Precision.fp16: "float16", Precision.bf16: "bfloat16"}


def is_quantized(precision: str) -> bool:
    """Whether a precision name (engines.yaml, a spec, a manifest) is one of the quantized ones; False for a name
    that is no precision at all."""
    return precision in QUANTIZED


def float_dtype(precision: str) -> str | None:
    """`Precision.float_dtype` of a precision name; None for a quantized one or a name that is no precision."""
    return _FLOAT_DTYPES.get(precision)  # a name finds its member: a str enum hashes and compares as its value
