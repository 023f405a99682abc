"""Provenance: who built each engine, where, with what, and the sha256 of every file it wrote.

The build stage writes `<workspace>/provenance/<key>.json` beside every engine it builds; `trt-diffusion
manifest` gathers them into the release manifest and verifies every file against its recorded sha256, so
a serving host can check that what it pulled is what the build hosts made.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .files import atomic_write_bytes, sha256_file, tool_versions
from .safe_paths import inside_folder

if TYPE_CHECKING:
    from ..engines_file import EngineSpec

SCHEMA_VERSION = 1


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), what provenance records and the bench scripts print."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_description() -> dict[str, str]:
    return {"host": socket.gethostname(), "cpu": cpu_name(), "machine": platform.machine(),
            "os": platform.platform(), "python": sys.version.split()[0]}


def engine_files(path: Path) -> list[Path]:
    """The files of an engine: its folder's files, or a single file and its same-stem siblings."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    stem = path.name.rsplit(".", 1)[0]
    return sorted(p for p in path.parent.glob(f"{stem}.*") if p.is_file())


def provenance_path(workspace: Path, key: str) -> Path:
    return Path(workspace) / "provenance" / f"{key}.json"


def record_provenance(workspace: Path, spec: EngineSpec, path: Path, seconds: float) -> dict:
    root = Path(workspace)
    files = {os.path.relpath(f, root): {"sha256": sha256_file(f), "bytes": f.stat().st_size} for f in engine_files(path)}
    record = {
        "schema_version": SCHEMA_VERSION, "key": spec.key, "name": spec.name, "target": spec.target,
        "model": spec.model, "component": spec.component, "precision": spec.precision,
        "engine": os.path.relpath(path, root), "files": files, "bytes": sum(f["bytes"] for f in files.values()),
        "build_seconds": round(seconds, 3), "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "built_by": host_description(), "tools": tool_versions("provenance"),
    }
    atomic_write_bytes(provenance_path(root, spec.key), json.dumps(record, indent=2).encode())
    return record


def release_manifest(config, specs: list[EngineSpec], *, verify: bool = True) -> dict:
    """Every engine of the matrix with its provenance; with `verify`, each file checked against its sha256.

    An engine is `ok` (every file as its build recorded), `modified` (a file differs from or is missing since
    its record, its manifest included), `unrecorded` (built, but no provenance record: built before records
    were kept) or `missing` (not built in this workspace).
    """
    from ..target_registry import get_target

    root = Path(config.workspace)
    entries = []
    for spec in specs:
        engine = get_target(spec.target).find(root, spec)
        record_file = provenance_path(root, spec.key)
        record = json.loads(record_file.read_text()) if record_file.is_file() else None
        entry = {"key": spec.key, "name": spec.name, "target": spec.target}
        if record is None:  # a record names the engine's files: without one only the engine's presence is known
            entry["status"] = "missing" if engine is None else "unrecorded"
        else:
            entry.update({k: record[k] for k in ("engine", "bytes", "build_seconds", "built_at", "built_by", "tools",
                                                 "files")})
            problems = []
            if verify:
                for relative, expected in record["files"].items():
                    try:  # a record from a shared workspace names paths inside it, never elsewhere
                        file = inside_folder(root, relative, where=str(record_file), field="files")
                    except ConfigError as exc:
                        problems.append(str(exc))
                        continue
                    if not file.is_file():
                        problems.append(f"{relative}: missing")
                    elif sha256_file(file) != expected["sha256"]:
                        problems.append(f"{relative}: sha256 differs from the build's record")
            entry["status"] = "modified" if problems else "ok"
            entry["problems"] = problems
        entries.append(entry)
    counts = {status: sum(e["status"] == status for e in entries) for status in ("ok", "modified", "unrecorded", "missing")}
    return {"schema_version": SCHEMA_VERSION, "engines_yaml": str(config.path), "verified": verify,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"), "counts": counts,
            "engines": entries}
