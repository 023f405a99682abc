"""Which TensorRT release and GPU an engine belongs to: versions as TensorRT ties plans to them, compute
capabilities by their sm_ names, and which runtime may deserialize a plan built by which release."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ...errors import BuildError


def parse_trt_version(version: str) -> tuple[int, int, int]:
    """'10.13.0.35' -> (10, 13, 0): the part an engine is tied to (the fourth is the build number)."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not match:
        raise BuildError(f"not a TensorRT version: {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def architecture_mismatch(wanted: str, compute_capability: Sequence[int]) -> str | None:
    """Why a plan for GPU architecture `wanted` cannot be built on a GPU of this compute capability."""
    here = sm_name(compute_capability)
    return None if here == wanted else f"engines for {wanted} are built on an {wanted} GPU; this host has {here}"


def sm_name(compute_capability: Sequence[int]) -> str:
    major, minor = compute_capability
    return f"sm_{major}{minor}"


def versions_compatible(built: str, runtime: str, version_compatible: bool) -> bool:
    """May a plan built with TensorRT `built` be deserialized by TensorRT `runtime`?

    Without VERSION_COMPATIBLE: only by the exact version it was built with (major.minor.patch). With it:
    by the same or a newer runtime of the same major, and across one major boundary the support matrix
    names: TensorRT 10 version-compatible engines run on a TensorRT 11 runtime. Never by an older runtime.
    """
    built_version, runtime_version = parse_trt_version(built), parse_trt_version(runtime)
    if not version_compatible:
        return built_version == runtime_version
    if runtime_version < built_version:
        return False
    return runtime_version[0] == built_version[0] or (built_version[0], runtime_version[0]) in CROSS_MAJOR_COMPATIBLE


# (built major, runtime major) pairs the TensorRT support matrix allows for version-compatible engines
CROSS_MAJOR_COMPATIBLE = frozenset({(10, 11)})
