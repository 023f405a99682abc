"""A no-op `export` that answers at once, as a no-op `build` does (engine_builds/build_state.py): a record of the
last complete export, trusted only while nothing it was made from or wrote has changed.

The full check hashes every weight file (the input hash) and every output (the store's verify): seconds on a
tiny model, minutes on a real one, plus torch's import. The record (`<workspace>/.export-state.json`) holds a
fingerprint of the inputs — engines.yaml's bytes, the export groups' keys, the export tools' versions, and the
(inode, size, mtime_ns) of every file under each model, ControlNet and LoRA source and of the package's own code
(an exporter or component declaration edited in a checkout changes what an export writes) — plus the (inode,
size, mtime_ns) of every file of each group's artifact. When all of that matches, the artifacts are reported
unchanged without hashing a file or importing torch; any difference falls back to the full check, which hashes
(and writes the record again). A file rewritten in place changes its mtime, one renamed over changes its inode:
the verdict workspace/manifests.py caches on engine folders, and make's, ninja's and git's index's.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ..engines_file import EnginesConfig
from ..workspace.files import atomic_write_bytes, stat_rows, tool_versions
from ..workspace.store import MANIFEST_NAME, Artifact
from .grouping import ExportGroup
from .results import ExportEvent, ExportReport, ExportResult, ProgressCallback

STATE_FILE = ".export-state.json"
SCHEMA_VERSION = 1
PACKAGE = Path(__file__).resolve().parents[1]


def source_paths(config: EnginesConfig, models: list[str] | None = None) -> list[Path]:
    """The files engines.yaml's models (or `models` of them) are made from: model, ControlNet and LoRA sources and
    calibration prompts. The no-op build's fingerprint (engine_builds/build_state.py) stats the same."""
    paths: list[Path] = []
    for name in dict.fromkeys(config.models if models is None else models):
        model = config.models[name]
        paths.append(model.source.path)
        paths += [source.path for source in model.controlnets.values()]
        paths += [lora.path for lora in model.loras.values()]
        prompts = getattr(model.quantization.calibration, "prompts", None)
        if prompts:
            paths.append(config.root / str(prompts))
    return paths


def fingerprint(config: EnginesConfig, groups: list[ExportGroup]) -> str:
    payload = {
        "schema": SCHEMA_VERSION,
        "engines_yaml": hashlib.sha256(Path(config.path).read_bytes()).hexdigest(),
        "groups": sorted([group.name, group.key] for group in groups),
        "tools": tool_versions("export"),
        "sources": [stat_rows(path) for path in source_paths(config, [group.model for group in groups])],
        "code": [row for path in sorted(PACKAGE.rglob("*.py")) for row in stat_rows(path)],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _state_path(config: EnginesConfig) -> Path:
    return Path(config.workspace) / STATE_FILE


def record(config: EnginesConfig, groups: list[ExportGroup], report: ExportReport, inputs: str) -> None:
    """Save the state of an export that gave every group its artifact (else forget any earlier one). `inputs`:
    the `fingerprint` taken before the export ran — one taken now would vouch for a source changed while it ran
    (a weight replaced, engines.yaml edited), whose new bytes the artifact was never made from."""
    by_key = {result.group.key: result for result in report.results}
    if not groups or any(group.key not in by_key for group in groups):
        _state_path(config).unlink(missing_ok=True)
        return
    state = {"fingerprint": inputs,
             "groups": {group.key: {"path": str(by_key[group.key].artifact.path),
                                    "files": stat_rows(by_key[group.key].artifact.path)} for group in groups}}
    atomic_write_bytes(_state_path(config), json.dumps(state).encode())


def unchanged_report(config: EnginesConfig, groups: list[ExportGroup], progress: ProgressCallback | None = None,
                     inputs: str | None = None) -> ExportReport | None:
    """The report of an export with nothing to do, when the saved state proves it; None to run the full check.
    `inputs`: the `fingerprint` of now, when the caller took it already."""
    started = time.perf_counter()
    try:
        state = json.loads(_state_path(config).read_text())
    except (OSError, ValueError):
        return None
    if not groups or state.get("fingerprint") != (inputs or fingerprint(config, groups)):
        return None
    artifacts = []
    for group in groups:
        entry = state.get("groups", {}).get(group.key)
        if entry is None:
            return None
        folder = Path(entry["path"])
        if stat_rows(folder) != entry["files"]:
            return None
        try:
            artifacts.append(Artifact(folder, json.loads((folder / MANIFEST_NAME).read_text())))
        except (OSError, ValueError):
            return None
    seconds = (time.perf_counter() - started) / len(groups)
    results = []
    for index, (group, artifact) in enumerate(zip(groups, artifacts, strict=True)):
        result = ExportResult(group, artifact, cached=True, seconds=seconds)
        results.append(result)
        if progress:
            progress(ExportEvent(group, "cached", index, len(groups), result))
    return ExportReport(results)
