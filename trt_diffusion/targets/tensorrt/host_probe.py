"""What this host has for the TensorRT target: the `tensorrt` module (imported inside functions only, so
importing trt-diffusion needs neither TensorRT nor a GPU) and the CUDA devices, with why not where they are
missing."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

from ...errors import MissingDependencyError
from .versions import sm_name

INSTALL_HINT = (
    "the tensorrt target needs TensorRT 10 and an NVIDIA GPU: "
    "pip install 'trt-diffusion[tensorrt]' --extra-index-url https://pypi.nvidia.com"
)
HostInfo = tuple[str, tuple[int, int], str]  # (TensorRT version, compute capability, device name)


def import_tensorrt() -> tuple[ModuleType | None, str]:
    """(the tensorrt module, "") or (None, why it cannot be used)."""
    try:
        import tensorrt as trt
    except Exception as err:  # noqa: BLE001 - ImportError, or OSError when its shared libraries are missing
        return None, f"the tensorrt module cannot be imported ({type(err).__name__}: {err})"
    if not hasattr(trt, "Builder"):
        # a namespace package left by type stubs, or NVIDIA's placeholder package without the libraries
        return None, "the installed 'tensorrt' package has no TensorRT libraries (a stub or placeholder package)"
    return trt, ""


def require_tensorrt() -> ModuleType:
    trt, reason = import_tensorrt()
    if trt is None:
        raise MissingDependencyError(f"{reason}; {INSTALL_HINT}")
    return trt


@dataclass(frozen=True)
class CudaDevice:
    compute_capability: tuple[int, int]
    name: str


def _device_from_cuda_python(index: int = 0) -> CudaDevice | str:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6 layout
        except ImportError as err:
            return f"cuda-python is not installed ({err})"
    success = cudart.cudaError_t.cudaSuccess
    status, count = cudart.cudaGetDeviceCount()
    if status != success:
        return f"the CUDA runtime reports {status.name}"
    if count <= index:
        return f"the CUDA runtime sees {count} device(s), no device {index}"
    status, props = cudart.cudaGetDeviceProperties(index)
    if status != success:
        return f"cudaGetDeviceProperties failed with {status.name}"
    name = props.name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    return CudaDevice((int(props.major), int(props.minor)), name)


def _device_from_torch(index: int = 0) -> CudaDevice | str:
    try:
        import torch
    except ImportError as err:
        return f"torch is not installed ({err})"
    if not torch.cuda.is_available():
        return f"torch sees no CUDA device (its build: CUDA {torch.version.cuda or 'none'})"
    if torch.cuda.device_count() <= index:
        return f"torch sees {torch.cuda.device_count()} CUDA device(s), no device {index}"
    major, minor = torch.cuda.get_device_capability(index)
    return CudaDevice((int(major), int(minor)), torch.cuda.get_device_name(index))


@functools.lru_cache(maxsize=16)
def probe_cuda_device(index: int = 0) -> tuple[CudaDevice | None, tuple[str, ...]]:
    """Device `index` as the CUDA runtime numbers it (honours CUDA_VISIBLE_DEVICES); cuda-python first,
    torch as the fallback. Cached: the GPUs do not change within a process."""
    reasons = []
    for probe in (_device_from_cuda_python, _device_from_torch):
        try:
            found = probe(index)
        except Exception as err:  # noqa: BLE001 - a broken CUDA install is a reason, not a crash
            found = f"{probe.__name__}: {type(err).__name__}: {err}"
        if isinstance(found, CudaDevice):
            return found, ()
        reasons.append(found)
    return None, tuple(reasons)


def tensorrt_available() -> tuple[bool, str]:
    """(True, a description of TensorRT and the GPU) or (False, why this host cannot use the target)."""
    trt, reason = import_tensorrt()
    if trt is None:
        return False, reason
    device, reasons = probe_cuda_device()
    if device is None:
        return False, "no CUDA device: " + "; ".join(reasons)
    return True, f"TensorRT {trt.__version__} on {device.name} ({sm_name(device.compute_capability)})"


def host_info(device_index: int = 0) -> HostInfo:
    """(TensorRT version, compute capability, name) of GPU `device_index`; MissingDependencyError otherwise."""
    trt = require_tensorrt()
    device, reasons = probe_cuda_device(device_index)
    if device is None:
        raise MissingDependencyError("no CUDA device: " + "; ".join(reasons) + f"; {INSTALL_HINT}")
    return str(trt.__version__), device.compute_capability, device.name
