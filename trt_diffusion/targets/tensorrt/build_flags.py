"""The builder settings of one engine, decided from its spec and its ONNX: the `tensorrt.BuilderFlag` and
`NetworkDefinitionCreationFlag` members to set, by name (engine.py sets them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from ...precision import PRECISIONS, is_quantized
from .manifest import TARGET
from .versions import parse_trt_version

GIB = 1 << 30


def _option_int(spec: EngineSpec, name: str, default: int, low: int, high: int) -> int:
    value = spec.option(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BuildError(f"{spec.name}: build option {name} must be an integer from {low} to {high}, got {value!r}")
    return value


def _option_workspace_bytes(spec: EngineSpec) -> int | None:
    """The builder's WORKSPACE pool limit; None (the default): no cap, as demo/Diffusion builds, so the large
    attention tactics of Wan 720p or 2K FLUX are not excluded. An explicit workspace_gb keeps its engine key."""
    value = spec.option("tensorrt_workspace_gb", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise BuildError(f"{spec.name}: build option tensorrt_workspace_gb must be a positive number, got {value!r}")
    return int(value * GIB)


def _check_precision(spec: EngineSpec, has_qdq: bool) -> None:
    precision = spec.precision
    if precision not in PRECISIONS:
        raise BuildError(f"{spec.name}: unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    quantized = is_quantized(precision)
    if quantized and not has_qdq:
        raise BuildError(
            f"{spec.name}: precision {precision} needs an ONNX with Q/DQ nodes from the quantize stage; this ONNX has none"
        )
    if has_qdq and not quantized:
        raise BuildError(
            f"{spec.name}: the ONNX carries Q/DQ nodes but the engine's precision is {precision}; "
            "a quantized ONNX belongs to fp8/int8 engines"
        )
    # fp8/int8 engines are refittable: a LoRA refit writes the weights and their recomputed weight scales
    # (`engine.refit_quantized_from_base`), the calibrated activation scales stay


@dataclass(frozen=True)
class BuildFlags:
    """The builder settings of one engine, decided from its spec and its ONNX.

    Every engine is strongly typed, on TensorRT 10 and 11 alike (TensorRT 11 has no other mode): the
    ONNX's own dtypes decide the precision of every layer, so no precision flag exists here. An fp16
    engine is built from an fp16 ONNX, a bf16 engine from a bf16 ONNX (both with fp32 I/O), an fp8/int8
    engine from a Q/DQ ONNX over fp16 or bf16 (see `precision.qdq_base_precision`).
    """

    precision: str
    # fp32 layers may use TF32 math (TensorRT's default); off where fp32 must match a reference to 1e-4
    tf32: bool = True
    strongly_typed: bool = True  # always: recorded so a manifest says how its plan was built
    refit: bool = False
    # STRIP_PLAN: a plan without its weights (a small release artifact); the runner refits them from the ONNX the
    # plan was built from when it loads (`engine.load_engine(weights_onnx=...)`). REFIT_IDENTICAL unless refittable.
    strip_plan: bool = False
    # WEIGHT_STREAMING: weights may stay in host memory and stream in at run time, within a budget the runner sets
    # (`weight_streaming_budget_v2`): FLUX-class models on GPUs smaller than their weights
    weight_streaming: bool = False
    version_compatible: bool = False
    builder_optimization_level: int = 3
    workspace_bytes: int | None = None  # None: TensorRT's default, the device's memory (no cap)

    @classmethod
    def for_spec(cls, spec: EngineSpec, has_qdq: bool) -> BuildFlags:
        if spec.target != TARGET:
            raise BuildError(f"{spec.name}: target is {spec.target!r}, not {TARGET!r}")
        _check_precision(spec, has_qdq)
        return cls(
            precision=spec.precision,
            tf32=bool(spec.option("tensorrt_tf32", True)),
            refit=spec.refittable,
            strip_plan=bool(spec.option("tensorrt_strip_plan", False)),
            weight_streaming=bool(spec.option("tensorrt_weight_streaming", False)),
            version_compatible=bool(spec.option("tensorrt_version_compatible", False)),
            builder_optimization_level=_option_int(spec, "tensorrt_optimization_level", 3, 0, 5),
            workspace_bytes=_option_workspace_bytes(spec),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def builder_flags(self) -> tuple[str, ...]:
        """`tensorrt.BuilderFlag` members to set, by name; the same on TensorRT 10 and 11 (none of them a
        precision flag: those are gone in 11, see tests/targets/test_tensorrt_removed_api.py)."""
        names = []
        if self.refit:
            names.append("REFIT")
        if self.strip_plan:
            names.append("STRIP_PLAN")
            if not self.refit:  # the weights come back from the very ONNX the plan was built from
                names.append("REFIT_IDENTICAL")
        if self.weight_streaming:
            names.append("WEIGHT_STREAMING")
        if self.version_compatible:
            names.append("VERSION_COMPATIBLE")
        return tuple(names)

    def cleared_builder_flags(self) -> tuple[str, ...]:
        """`tensorrt.BuilderFlag` members to clear (TF32 is on by default in a builder config)."""
        return () if self.tf32 else ("TF32",)


def network_creation_flags(trt_version: str) -> tuple[str, ...]:
    """`tensorrt.NetworkDefinitionCreationFlag` members for `create_network`, by name.

    TensorRT 10 builds weakly typed unless STRONGLY_TYPED is set; TensorRT 11 networks are always strongly
    typed and the flag is deprecated there (accepted and ignored), so it is not set.
    """
    return ("STRONGLY_TYPED",) if parse_trt_version(trt_version)[0] < 11 else ()
