"""What this host refuses before TensorRT starts, each with a message that names the engine, the host and
what to do: a precision its GPU cannot run, a refittable engine on a TensorRT release with a known refit
defect, and a plan built for another TensorRT release or GPU architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...engines_file.engine_spec import EngineSpec
from ...errors import BuildError
from ...precision import Precision, is_quantized
from .manifest import REBUILD_COMMAND
from .precision import qdq_base_precision
from .versions import parse_trt_version, sm_name, versions_compatible

if TYPE_CHECKING:
    from .manifest import EngineManifest


# The lowest compute capability whose tensor cores run each precision (TensorRT support matrix):
# BF16 from Ampere (8.0), FP8 from Ada / Hopper (8.9). fp32, fp16 and int8 run on every GPU TensorRT 10/11 supports.
PRECISION_MIN_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {Precision.bf16: (8, 0), Precision.fp8: (8, 9)}


def check_hardware(spec: EngineSpec, compute_capability: tuple[int, int], device_name: str) -> None:
    """BuildError naming the engine, its precision and the GPU when this GPU cannot run the precision."""
    needed = PRECISION_MIN_COMPUTE_CAPABILITY.get(spec.precision)
    if is_quantized(spec.precision) and qdq_base_precision(spec) == Precision.bf16:  # int8 over bf16: Ampere
        needed = max(needed or (0, 0), PRECISION_MIN_COMPUTE_CAPABILITY[Precision.bf16])
    if needed is not None and tuple(compute_capability) < needed:
        raise BuildError(
            f"{spec.name}: precision {spec.precision} needs a GPU of compute capability {needed[0]}.{needed[1]} or "
            f"newer; this host's GPU is {device_name} ({sm_name(compute_capability)}, compute capability "
            f"{compute_capability[0]}.{compute_capability[1]}). Build it on such a GPU or choose another precision"
        )


# TensorRT releases with a known defect in refittable engines, and NVIDIA's words for it (the 11.3 release
# notes' known issues): a gpu test (tests/targets/test_tensorrt_gpu.py) compares a refittable engine with ONNX
# Runtime before a release leaves this list.
REFIT_KNOWN_ISSUES: dict[tuple[int, int], str] = {
    (11, 3): "TensorRT 11.3 can drop the bias of a GEMM in engines built with the REFIT flag (NVIDIA's known issue "
             "in the 11.3 release notes), so a refittable engine may compute wrong results",
}
REFIT_WAIVER_OPTION = "tensorrt_allow_refit_on_11_3"


def check_refit_supported(spec: EngineSpec, trt_version: str) -> None:
    """BuildError for a refittable spec on a TensorRT release with a known refit defect, unless engines.yaml
    waives it (`build.tensorrt.allow_refit_on_11_3: true`)."""
    issue = REFIT_KNOWN_ISSUES.get(parse_trt_version(trt_version)[:2])
    if spec.refittable and issue and not spec.option(REFIT_WAIVER_OPTION, False):
        raise BuildError(
            f"{spec.name}: refittable engines are refused on TensorRT {trt_version}: {issue}. Build on another "
            "TensorRT release, make the model not refittable (LoRAs `mode: fused`), or accept the risk with "
            "`build: {tensorrt: {allow_refit_on_11_3: true}}` in engines.yaml and check the engine with `parity`"
        )


def check_engine_compatible(
    manifest: EngineManifest,
    runtime_trt_version: str,
    runtime_compute_capability: tuple[int, int],
    runtime_device_name: str | None = None,
) -> None:
    """Refuse an engine built for another TensorRT version or GPU architecture, before TensorRT
    fails to deserialize it with a message that names neither."""
    version_compatible = bool(manifest.flags.get("version_compatible", False))
    version_ok = versions_compatible(manifest.tensorrt_version, runtime_trt_version, version_compatible)
    cc_ok = tuple(manifest.compute_capability) == tuple(runtime_compute_capability)
    if version_ok and cc_ok:
        return
    built = f"TensorRT {manifest.tensorrt_version} for {sm_name(manifest.compute_capability)} ({manifest.device_name})"
    host_device = f" ({runtime_device_name})" if runtime_device_name else ""
    host = f"TensorRT {runtime_trt_version} and {sm_name(runtime_compute_capability)}{host_device}"
    rules = []
    if not version_ok:
        rules.append(
            "a version-compatible engine loads only on the TensorRT version it was built with or a newer one of the "
            "same major (a TensorRT 10 one also on TensorRT 11)"
            if version_compatible
            else "a TensorRT engine loads only on the exact TensorRT version (major.minor.patch) it was built with"
        )
    if not cc_ok:
        rules.append("an engine runs only on GPUs of the compute capability it was built for")
    raise BuildError(
        f"engine {manifest.spec_name} was built with {built}; this host has {host}: {'; '.join(rules)}. "
        f"Rebuild on this host with `{REBUILD_COMMAND}`"
    )
