"""Which ONNX a TensorRT engine of each precision is built from, and the check that it is that ONNX (a
strongly typed engine computes in its graph's dtypes)."""

from __future__ import annotations

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from ...precision import Precision, float_dtype, is_quantized


# The ONNX a tensorrt engine of each precision is built from (strong typing: the graph's dtypes are the
# engine's). fp8/int8: Q/DQ nodes over the family's Q/DQ base graph (`qdq_base_precision`), so the layers left
# unquantized run in fp16 or bf16, not fp32.
# Families whose denoiser is a transformer (DiT): their activations exceed fp16's range (FLUX, SD3, and their
# T5 encoders), so NVIDIA's demo builds their fp8/int8 engines over bf16. Derived from families.py, so a DiT
# family added there gets bf16 without an edit here.
def _dit_families() -> frozenset[str]:
    from ...families import FAMILIES, Component

    return frozenset(f.value for f, info in FAMILIES.items() if info.denoiser == Component.transformer)


def qdq_base_precision(spec: EngineSpec) -> str:
    """The float precision a spec's engine computes in outside its Q/DQ layers: the spec's own for fp32, fp16
    and bf16; for fp8/int8 the family's Q/DQ base: bf16 for the DiT families, fp16 for the UNet ones."""
    if not is_quantized(spec.precision):
        return spec.precision
    return Precision.bf16 if spec.family in _dit_families() else Precision.fp16


def check_onnx_precision(spec: EngineSpec, compute_dtype: str | None) -> None:
    """A strongly typed engine runs in the ONNX's dtypes: refuse an ONNX whose float weights are not the
    dtype the spec's precision needs (an "fp16" engine from an fp32 graph would silently be fp32).
    `compute_dtype` is `onnx_compute_dtype(onnx)`; None (no float weights) passes."""
    base = qdq_base_precision(spec)
    wanted = float_dtype(base)
    if compute_dtype is not None and compute_dtype != wanted:
        graph = f"a Q/DQ ONNX over the {base} graph" if is_quantized(spec.precision) else f"an {wanted} ONNX"
        raise BuildError(
            f"{spec.name}: a {spec.precision} TensorRT engine is built strongly typed from {graph}, but this ONNX's "
            f"weights are {compute_dtype}: re-export it (`trt-diffusion export`) so its precision matches the spec"
        )
