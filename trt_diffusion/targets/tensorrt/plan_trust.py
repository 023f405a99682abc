"""Is a plan the one its manifest describes? The plan's sha256, the refit-in-progress refusal, the host-code gate.

A version-compatible plan carries TensorRT's lean runtime, which `deserialize_cuda_engine` runs as host code
when `engine_host_code_allowed` is set: whoever can plant a plan beside a manifest that says
`version_compatible` would run code in every process that loads it (`refit`, runners, `parity`, preflight).
So a plan is trusted by the sha256 its manifest records (#32 finding 4), checked on the very bytes handed to
TensorRT, and host code is allowed only where that digest matched and the spec asks for
`tensorrt_version_compatible`. `find` and the no-op build use a verdict cached on (inode, size, mtime_ns), so
they stay fast on multi-GB plans; loading and packaging hash in full. Pure Python: tested on CPU.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

from ...errors import BuildError
from .manifest import REBUILD_COMMAND, EngineManifest

RESTORE_COMMAND = "trt-diffusion refit engines.yaml --model MODEL --base"
_VERDICTS: dict[tuple[str, int, int, int], str] = {}
_VERDICTS_LOCK = threading.Lock()


def plan_sha256(data: Any) -> str:
    """sha256 of a plan held in memory (bytes, or TensorRT's IHostMemory: any buffer)."""
    return hashlib.sha256(memoryview(data)).hexdigest()


def plan_file_sha256(path: str | Path, *, cached: bool = True) -> str:
    """sha256 of a plan file; with `cached`, an earlier verdict on the same (inode, size, mtime_ns) is reused."""
    path = Path(path)
    stat = path.stat()
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if cached:
        with _VERDICTS_LOCK:
            if key in _VERDICTS:
                return _VERDICTS[key]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    with _VERDICTS_LOCK:
        _VERDICTS[key] = digest.hexdigest()
    return _VERDICTS[key]


def _accepted_digests(manifest: EngineManifest, for_refit: bool) -> set[str]:
    """The plan digests a manifest vouches for. While a refit is being saved, the plan on disk is the one before
    it or the one after it; only `refit` (which restores every weight from the ONNX) may take either."""
    accepted = {manifest.plan_sha256} if manifest.plan_sha256 else set()
    if for_refit and manifest.refit is not None and manifest.refit.in_progress and manifest.refit.replacing_sha256:
        accepted.add(manifest.refit.replacing_sha256)
    return accepted


def interrupted_refit_problem(manifest: EngineManifest) -> str | None:
    if manifest.refit is not None and manifest.refit.in_progress:
        return (f"engine {manifest.spec_name}: a refit of its plan was interrupted (its manifest says a refit is in "
                f"progress), so the plan holds neither its base weights nor the LoRA's for certain: restore it with "
                f"`{RESTORE_COMMAND}` or rebuild with `{REBUILD_COMMAND}`")
    return None


def digest_problem(manifest: EngineManifest, digest: str, source: str, *, for_refit: bool = False) -> str | None:
    """Why a plan whose sha256 is `digest` is not the one `manifest` describes (None: it is)."""
    if not manifest.plan_sha256:
        return f"{source}: its manifest records no plan sha256 (written by an older trt-diffusion): rebuild with " \
               f"`{REBUILD_COMMAND}`"
    if digest not in _accepted_digests(manifest, for_refit):
        return (f"{source} does not match the plan sha256 its manifest records (changed or replaced since it was "
                f"built): it is not loaded; rebuild with `{REBUILD_COMMAND}`")
    return None


def plan_file_problem(manifest: EngineManifest, plan_path: str | Path, *, cached: bool = True,
                      for_refit: bool = False) -> str | None:
    """Why the plan file is not the one its manifest describes: missing, another size, another sha256."""
    plan_path = Path(plan_path)
    if not plan_path.is_file():
        return f"engine plan {plan_path} is missing: rebuild with `{REBUILD_COMMAND}`"
    size = plan_path.stat().st_size
    if size != manifest.plan_bytes and not (for_refit and manifest.refit is not None and manifest.refit.in_progress):
        return (f"engine plan {plan_path} has {size} bytes, its manifest says {manifest.plan_bytes} (an interrupted "
                f"copy?): rebuild with `{REBUILD_COMMAND}`")
    return digest_problem(manifest, plan_file_sha256(plan_path, cached=cached), f"engine plan {plan_path}",
                          for_refit=for_refit)


def check_plan_bytes(manifest: EngineManifest, data: Any, source: str, *, for_refit: bool = False) -> str:
    """The sha256 of `data` when it is the plan `manifest` describes, refit state included; BuildError otherwise.
    Checked on the bytes TensorRT is given, so nothing can change them between the check and the load."""
    if not for_refit:
        problem = interrupted_refit_problem(manifest)
        if problem:
            raise BuildError(problem)
    digest = plan_sha256(data)
    problem = digest_problem(manifest, digest, source, for_refit=for_refit)
    if problem:
        raise BuildError(problem)
    return digest


def host_code_allowed(manifest: EngineManifest, verified_digest: str | None, spec: Any = None) -> bool:
    """May TensorRT run the host code a plan embeds (`engine_host_code_allowed`)? Only for a plan whose bytes
    were just matched to its manifest's sha256 (`verified_digest`, from `check_plan_bytes`), built
    version-compatible, and, where the engine's spec is known, for that very spec asking for
    `tensorrt_version_compatible` (a manifest's flags alone are what a planted file would say)."""
    if not verified_digest or verified_digest not in _accepted_digests(manifest, for_refit=True):
        return False
    if not manifest.flags.get("version_compatible"):
        return False
    if spec is not None:
        return bool(spec.option("tensorrt_version_compatible", False)) and spec.key == manifest.spec_key
    return True
