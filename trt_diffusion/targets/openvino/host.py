"""What this host's CPU can compute, as OpenVINO sees it, and the fingerprint that keys compiled-model caches.

`OPTIMIZATION_CAPABILITIES` of OpenVINO's CPU plugin is the authority on precision (it lists BF16 only
where the CPU has AMX-BF16 or AVX512-BF16, FP16 only where it computes fp16 natively); the ISA flags from
/proc/cpuinfo are recorded beside it so a manifest says *why*.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
from dataclasses import asdict, dataclass

from ...extras import install_line

PACKAGE = "openvino"
PINNED_VERSION = "2026.4.1"
INSTALL_HINT = f"{install_line('openvino')} (openvino=={PINNED_VERSION})"

# The flags that decide what OpenVINO's CPU plugin can do fast (x86 and ARM spellings).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
             "asimd", "asimdhp", "fphp", "asimddp", "bf16", "i8mm", "sve")  # not a precision: ARM's bf16 flag


def unavailable_reason() -> str | None:
    """None when openvino can be imported here (checked without importing it)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return f"the openvino package is not installed ({INSTALL_HINT})"
    return None


def require_openvino():
    from ...errors import MissingDependencyError

    reason = unavailable_reason()
    if reason is not None:
        raise MissingDependencyError(f"the openvino target needs OpenVINO: {reason}")
    import openvino

    return openvino


def cpu_flags() -> tuple[str, ...]:
    """The ISA flags of ISA_FLAGS this CPU reports (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return ()
    present: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            present.update(value.split())
    return tuple(flag for flag in ISA_FLAGS if flag in present)


@dataclass(frozen=True)
class CpuFacts:
    openvino_version: str
    device_name: str
    architecture: str  # x86_64 | arm64 | ...
    capabilities: tuple[str, ...]  # OpenVINO's OPTIMIZATION_CAPABILITIES: FP32, BF16, FP16, INT8, ...
    isa_flags: tuple[str, ...]

    def fingerprint(self) -> str:
        """Changes when OpenVINO or the CPU changes: the key of the compiled-model cache folder."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def has(self, capability: str) -> bool:
        return capability in self.capabilities


@functools.lru_cache(maxsize=1)
def cpu_facts() -> CpuFacts:
    ov = require_openvino()
    core = ov.Core()
    try:
        architecture = str(core.get_property("CPU", "DEVICE_ARCHITECTURE"))
    except Exception:  # noqa: BLE001 - older plugins have no such property
        architecture = platform.machine()
    return CpuFacts(openvino_version=ov.get_version(), device_name=str(core.get_property("CPU", "FULL_DEVICE_NAME")),
                    architecture=architecture,
                    capabilities=tuple(str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
                    isa_flags=cpu_flags())


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
