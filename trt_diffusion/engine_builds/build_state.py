"""A no-op `build` that answers at once: a record of the last complete build, trusted only while nothing it
was made from or wrote has changed.

The record (`<workspace>/.build-state.json`) holds a fingerprint of the inputs — engines.yaml's bytes, the
keys of the engines wanted (which hash every spec field; a target that becomes available adds keys), the
installed tool versions, and the inode, size and mtime of every file under each model,
ControlNet, LoRA and calibration source — plus the inode, size and mtime of every engine file and of every
manifest. When all of that matches, the engines are reported unchanged without importing torch,
diffusers or onnx; any difference (a touched weight, an upgraded onnxruntime, an edited engine) falls
back to the full check, which verifies content hashes through the manifests. This is how make, ninja
and git's index decide: a file's stat changes whenever its content is rewritten.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..engines_file import EnginesConfig, EngineSpec
from ..export.export_state import source_paths
from ..workspace.files import atomic_write_bytes, stat_rows, tool_versions
from .report import BuildReport, EngineOutcome

STATE_FILE = ".build-state.json"
SCHEMA_VERSION = 1
def fingerprint(config: EnginesConfig, specs: list[EngineSpec]) -> str:
    payload = {
        "schema": SCHEMA_VERSION,
        "engines_yaml": hashlib.sha256(Path(config.path).read_bytes()).hexdigest(),
        "engines": sorted(spec.key for spec in specs),
        "tools": tool_versions("build"),
        "sources": [stat_rows(path) for path in source_paths(config)],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _engine_stats(path: Path) -> list:
    stats = stat_rows(path)
    if Path(path).is_file():  # a single-file engine keeps its manifest beside it
        stats += [s for sibling in sorted(Path(path).parent.glob(Path(path).name.split(".plan")[0] + ".*"))
                  if sibling != Path(path) for s in stat_rows(sibling)]
    return stats


def record(config: EnginesConfig, report: BuildReport) -> None:
    """Save the state of a build that left every wanted engine built (else forget any earlier one)."""
    state_path = Path(config.workspace) / STATE_FILE
    if report.failed or not report.outcomes:
        state_path.unlink(missing_ok=True)
        return
    state = {"fingerprint": fingerprint(config, [o.spec for o in report.outcomes]),
             "engines": {o.spec.key: {"path": str(o.path), "files": _engine_stats(o.path)} for o in report.outcomes}}
    atomic_write_bytes(state_path, json.dumps(state).encode())


def unchanged_report(config: EnginesConfig, specs: list[EngineSpec],
                     skipped_targets: dict[str, str]) -> BuildReport | None:
    """The report of a build with nothing to do, when the saved state proves it; None to run the full check."""
    try:
        state = json.loads((Path(config.workspace) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not specs or state.get("fingerprint") != fingerprint(config, specs):
        return None
    engines = state.get("engines", {})
    outcomes = []
    for spec in specs:
        entry = engines.get(spec.key)
        if entry is None:
            return None
        path = Path(entry["path"])
        if [list(s) for s in _engine_stats(path)] != entry["files"]:
            return None
        outcomes.append(EngineOutcome(spec, path, cached=True))
    return BuildReport(outcomes=outcomes, skipped_targets=dict(skipped_targets))
