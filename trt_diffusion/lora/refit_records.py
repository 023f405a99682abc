"""The records a refit map is made of: where a torch parameter lives in an ONNX graph (`RefitTarget`), how it
was matched, and, for fp8/int8 graphs, how the weight is quantized there (`WeightQuantization`). Plain data,
shared by the map builder (`refit_map.py`) and the quantized refit (`quantized_refit.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

Shape = tuple[int, ...]


@dataclass(frozen=True)
class WeightQuantization:
    """How one refitted weight is quantized in the graph.

    `kind`: "int8" (float initializer behind QuantizeLinear) or "fp8" (float8 initializer behind
    DequantizeLinear). `scale`: the initializer holding its scale; `axis`: the per-channel axis in the stored
    layout (None: one scale). `smoothing`: SmoothQuant's per-input-channel `pre_quant_scale` (the stored weight
    is W / smoothing), or None.
    """

    kind: str
    scale: str
    axis: int | None
    scale_shape: tuple[int, ...]
    smoothing: tuple[float, ...] | None = None

    def to_json(self) -> dict:
        return {"kind": self.kind, "scale": self.scale, "axis": self.axis, "scale_shape": list(self.scale_shape),
                "smoothing": list(self.smoothing) if self.smoothing is not None else None}

    @classmethod
    def from_json(cls, data: dict) -> WeightQuantization:
        smoothing = data.get("smoothing")
        axis = data.get("axis")
        return cls(kind=str(data["kind"]), scale=str(data["scale"]), axis=None if axis is None else int(axis),
                   scale_shape=tuple(int(d) for d in data["scale_shape"]),
                   smoothing=None if smoothing is None else tuple(float(v) for v in smoothing))


class MatchedBy(str, Enum):
    name = "name"
    node = "node"
    value = "value"


@dataclass(frozen=True)
class RefitTarget:
    """Where one torch parameter lives in the ONNX: write `W.T if transpose else W`, reshaped to `shape`."""

    initializer: str
    transpose: bool
    shape: Shape
    dtype: str  # the initializer's numpy dtype name
    matched_by: MatchedBy
    # fp8/int8 engines: the weight's quantizer, whose scale a refit recomputes (lora/quantized_refit.py)
    quantization: WeightQuantization | None = None
