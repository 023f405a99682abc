"""The openvino target's precision policy (pure): what each engines.yaml precision computes on a CPU with
given OpenVINO capabilities, and the refusals that keep a name honest."""

from __future__ import annotations

import pytest

from trt_diffusion.errors import BuildError
from trt_diffusion.targets.openvino import precision

AMX = ("FP32", "BF16", "FP16", "INT8", "BIN", "EXPORT_IMPORT")  # a Sapphire Rapids Xeon
AVX2 = ("FP32", "INT8", "BIN", "EXPORT_IMPORT")  # an AVX2-only CPU (no bf16, no native fp16)


def test_fp32_is_f32_everywhere():
    assert precision.resolve("fp32", AMX).hint == "f32"  # never OpenVINO's bf16 default on AMX
    assert precision.resolve("fp32", AVX2).hint == "f32"


def test_bf16_runs_bf16_with_amx_and_is_refused_without():
    assert precision.resolve("bf16", AMX).hint == "bf16"
    with pytest.raises(BuildError, match=r"bf16.*AMX-BF16 or AVX512-BF16.*silently run f32"):
        precision.resolve("bf16", AVX2, "AMD EPYC")


def test_fp16_is_refused_where_not_native_naming_bf16():
    assert precision.resolve("fp16", AMX).hint == "f16"
    with pytest.raises(BuildError, match=r"fp16.*use bf16"):
        precision.resolve("fp16", ("FP32", "BF16", "INT8"))
    with pytest.raises(BuildError, match=r"fp16.*bf16 on a CPU with AMX-BF16"):
        precision.resolve("fp16", AVX2)


def test_int8_is_i8_with_the_rest_in_bf16_only_where_the_cpu_has_it():
    assert (precision.resolve("int8", AMX).hint, precision.resolve("int8", AMX).quantized) == ("bf16", "i8")
    assert (precision.resolve("int8", AVX2).hint, precision.resolve("int8", AVX2).quantized) == ("f32", "i8")
    with pytest.raises(BuildError, match="int8"):
        precision.resolve("int8", ("FP32",))


def test_fp8_says_it_is_emulated():
    compute = precision.resolve("fp8", AVX2)
    assert compute.quantized == "f8-emulated" and "no fp8 arithmetic" in compute.summary


def test_plan_note_says_what_runs_here_and_elsewhere():
    assert precision.plan_note("bf16", AVX2).startswith("openvino here: refused on this CPU; elsewhere: bf16 on AMX")
    assert "here: bf16" in precision.plan_note("bf16", AMX)
    assert "ARM" in precision.plan_note("bf16") and "openvino here" not in precision.plan_note("bf16")
