"""One description of a concrete tensor: its dtype and shape as an engine, a manifest or a runner declares them.

`TensorSpec` is what an engine's manifest records for each input and output (`onnx_io` reads it off an ONNX
graph; TensorRT and OpenVINO off the built engine) and what a runner's `inputs` hold, keyed by name, for
`BaseRunner` to check feeds against. A dim is a fixed size, or unknown until run time: -1 (as manifests write
it), None, or a symbol (ONNX Runtime reports `"batch"`). dtype is numpy's name where numpy has one
(`bfloat16`, `float8e4m3` are not numpy's own).

A component's *declaration* (components/base.py `TensorDecl`) is another thing and stays apart: its dims are
symbolic multiples of the batch and latent axes, the rule that gives every geometry its shape and the exporter
its dynamic axes; a `TensorSpec` is what one engine or runner holds once that rule was applied.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, field_validator
from pydantic.dataclasses import dataclass

Dim = int | str | None  # a fixed size, or a dynamic one: -1, None or a symbol


def is_fixed(dim: Dim) -> bool:
    return isinstance(dim, int) and dim >= 0


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TensorSpec:
    dtype: str  # numpy's dtype name where numpy has one; a numpy dtype or type is taken by its name
    shape: tuple[Dim, ...]
    name: str = ""  # the tensor's name where the record stands alone (a manifest); a runner keys its inputs by it

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        import numpy as np

        return np.dtype(value).name

    def describe(self) -> str:
        dims = ",".join(str(d) if is_fixed(d) else (d if isinstance(d, str) else "?") for d in self.shape)
        return f"{self.dtype}[{dims}]"
