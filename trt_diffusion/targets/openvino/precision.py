"""Honest precision: what an engines.yaml precision computes on a CPU, or why it is refused. Pure Python.

OpenVINO's CPU plugin silently computes something else when asked for a precision the CPU lacks (bf16 or
f16 hints fall back to f32; its default on AMX CPUs is bf16 even for an fp32 model). The target therefore
always sets INFERENCE_PRECISION_HINT itself and refuses what the CPU cannot compute under that name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import BuildError
from ...precision import Precision, is_quantized

# The layer types whose runtime precision is the engine's real arithmetic (the rest is glue).
HEAVY_LAYERS = frozenset({"Convolution", "FullyConnected", "MatMul", "ScaledDotProductAttention",
                          "ScaledAttn", "Deconvolution", "GroupConvolution"})


# OpenVINO's INFERENCE_PRECISION_HINT values: its own vocabulary, where "bf16" is spelled like our precision
HINT_F32, HINT_BF16, HINT_F16 = "f32", "bf16", "f16"  # not a precision


@dataclass(frozen=True)
class Compute:
    hint: str  # OpenVINO's INFERENCE_PRECISION_HINT: f32 | bf16 | f16
    quantized: str | None  # i8 (Q/DQ layers in int8) | f8-emulated | None
    summary: str  # one line for manifests and `plan`


def _lacks(what: str, name: str, capabilities) -> str:
    return (f"this CPU ({name}) cannot compute {what} natively (OpenVINO reports {', '.join(capabilities) or 'nothing'})")


def resolve(precision: str, capabilities, device_name: str = "this CPU") -> Compute:
    """What `precision` runs as on a CPU with these OPTIMIZATION_CAPABILITIES; BuildError when it would
    have to run as something else under its name."""
    caps = set(capabilities)
    if precision == Precision.fp32:
        return Compute(HINT_F32, None, "f32")
    if precision == Precision.bf16:
        if "BF16" not in caps:
            raise BuildError(f"bf16: {_lacks(precision, device_name, sorted(caps))}: it needs AMX-BF16 or "
                             "AVX512-BF16, and OpenVINO would silently run f32 under the bf16 name; build fp32 "
                             "for this host, or build bf16 on a CPU with AMX (Xeon 4th gen or later)")
        return Compute(HINT_BF16, None, "bf16 (AMX-BF16/AVX512-BF16)")
    if precision == Precision.fp16:
        if "FP16" not in caps:
            alternative = "bf16, which this CPU computes natively" if "BF16" in caps else \
                "bf16 on a CPU with AMX-BF16/AVX512-BF16, or fp32 here"
            raise BuildError(f"fp16: {_lacks(precision, device_name, sorted(caps))} (it needs AVX512-FP16/AMX-FP16 "
                             f"or ARMv8.2 fp16); nothing else is computed under the fp16 name: use {alternative}")
        return Compute(HINT_F16, None, "f16 (native)")
    if is_quantized(precision):
        rest = HINT_BF16 if "BF16" in caps else HINT_F32
        if precision == Precision.int8:
            if "INT8" not in caps:
                raise BuildError(f"int8: {_lacks(precision, device_name, sorted(caps))}")
            return Compute(rest, "i8", f"int8 Q/DQ layers in i8, the other layers in {rest}")
        return Compute(rest, "f8-emulated", "fp8: no fp8 arithmetic on CPUs; OpenVINO keeps the weights in "
                       f"f8e4m3, rounds activations to f8 (FakeConvert) and computes in {rest}: fp8 accuracy, "
                       "no speed-up")
    raise BuildError(f"the openvino target has no precision {precision!r}")


def plan_note(precision: str, capabilities=None, device_name: str = "this CPU") -> str:
    """What `plan` shows: what runs here (when OpenVINO is installed) and what other CPUs would get."""
    elsewhere = {
        Precision.fp32: "f32 on every CPU",
        Precision.bf16: "bf16 on AMX/AVX512-BF16 CPUs; refused on CPUs without them (older x86, AMD before Zen 4, "
                "ARM): build fp32 there",
        Precision.fp16: "f16 where native (AVX512-FP16/AMX-FP16 Xeons, ARMv8.2+); refused elsewhere, naming bf16",
        Precision.int8: "i8 Q/DQ layers on any CPU with INT8 (VNNI/AMX-INT8 fast; AVX2 slower), other layers bf16 "
                "with AMX, else f32",
        Precision.fp8: "emulated on every CPU (f8 weights, FakeConvert activations, f32/bf16 arithmetic)",
    }.get(precision, "")
    if capabilities is None:
        return f"openvino: {elsewhere}"
    try:
        here = resolve(precision, capabilities, device_name).summary
    except BuildError:
        here = "refused on this CPU"
    return f"openvino here: {here}; elsewhere: {elsewhere}"


def runtime_precisions(compiled) -> dict[str, int]:
    """Heavy layers of a compiled model by the precision they run in, e.g. {"bf16": 120, "i8": 64}."""
    counts: dict[str, int] = {}
    for op in compiled.get_runtime_model().get_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in HEAVY_LAYERS:
            precision = info["runtimePrecision"].astype(str)
            counts[precision] = counts.get(precision, 0) + 1
    return dict(sorted(counts.items()))
