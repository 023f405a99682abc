"""The artifact store: content-addressed folders with manifests, written atomically.

Layout: `<root>/<kind>/<name>.<key>/` where key is the first 16 hex digits of the input hash, holding
the stage's files and `manifest.json`. A stage is skipped only when the manifest records the same input
hash *and* every recorded output is there with its recorded sha256 — never because a file exists.

A writer works in a temporary folder beside the target (`.tmp.<name>.<key>.<pid>.<random>`), holding an
advisory lock on a sibling `.lock` file; the manifest is written last and the folder renamed into place.
A killed process leaves only a temporary folder whose lock nobody holds: lookups never look there, and
the next writer of that kind removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .files import atomic_write_bytes, sha256_file

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
KEY_LENGTH = 16
TEMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
LOCK_SUFFIX = ".lock"
_RESERVED = ("schema_version", "kind", "name", "input_hash", "outputs", "created")
_UNLOCKED_GRACE_S = 300  # a temp folder without a lock file is only just being created, or long dead
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._+-]")


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def hash_inputs(inputs: Mapping[str, Any]) -> str:
    """sha256 of a JSON-able description of everything a stage's output depends on."""
    return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()


def safe_name(name: str) -> str:
    return _SAFE_NAME.sub("_", name)


def inside(root: str | os.PathLike, path: str | os.PathLike) -> Path:
    """`path`, once it is checked to lie inside `root` (artifacts never leave their workspace).

    Checked on the path as written ('..' folded), not through symbolic links: the workspace's owner may
    link a folder of it to another disk; a name must not climb out of it."""
    base, target = Path(os.path.abspath(root)), Path(os.path.abspath(path))
    if target != base and base not in target.parents:
        raise ConfigError(f"{path} is outside the workspace {base}; names in engines.yaml must not be paths")
    return Path(path)


@dataclass(frozen=True)
class Artifact:
    """A verified, committed stage output."""

    path: Path
    manifest: dict

    def file(self, relative: str) -> Path:
        return self.path / relative

    @property
    def input_hash(self) -> str:
        return self.manifest["input_hash"]

    @property
    def outputs(self) -> list[dict]:
        return self.manifest["outputs"]


@dataclass
class ArtifactWriter:
    """Write a stage's files under `path`; add to `manifest`. Committed when the `with` block ends cleanly."""

    kind: str
    name: str
    input_hash: str
    path: Path
    final_path: Path
    manifest: dict = field(default_factory=dict)


class ArtifactStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def folder(self, kind: str, name: str, input_hash: str) -> Path:
        return inside(self.root, self.root / safe_name(kind) / f"{safe_name(name)}.{input_hash[:KEY_LENGTH]}")

    # --- reading -----------------------------------------------------------------------------

    def lookup(self, kind: str, name: str, input_hash: str, *, verify: bool = True) -> Artifact | None:
        """The committed artifact for these inputs, or None (with the reason logged at debug level)."""
        folder = self.folder(kind, name, input_hash)
        reason = _invalid_reason(folder, kind, input_hash, verify)
        if reason:
            log.debug("no usable %s artifact %s: %s", kind, folder.name, reason)
            return None
        return Artifact(folder, json.loads((folder / MANIFEST_NAME).read_text()))

    # --- writing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def writer(self, kind: str, name: str, input_hash: str) -> Iterator[ArtifactWriter]:
        final = self.folder(kind, name, input_hash)
        final.parent.mkdir(parents=True, exist_ok=True)
        self.clean_stale(kind)
        temp = final.with_name(f"{TEMP_PREFIX}{final.name}.{os.getpid()}.{secrets.token_hex(4)}")
        lock = _hold_lock(_lock_path(temp))  # locked before the folder exists: a cleaner never sees it unlocked
        temp.mkdir()
        writer = ArtifactWriter(kind, name, input_hash, temp, final)
        try:
            yield writer
            _commit(writer)
        finally:
            shutil.rmtree(temp, ignore_errors=True)  # gone already when committed
            _release_lock(lock, _lock_path(temp))

    def clean_stale(self, kind: str | None = None) -> list[Path]:
        """Remove temporary folders no live writer holds (left by killed processes)."""
        kinds = [self.root / safe_name(kind)] if kind else [p for p in self.root.glob("*") if p.is_dir()]
        removed = []
        for kind_dir in kinds:
            if not kind_dir.is_dir():
                continue
            for entry in sorted(kind_dir.iterdir()):
                if entry.name.startswith(TRASH_PREFIX):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
                elif entry.name.startswith(TEMP_PREFIX) and entry.is_dir() and _is_abandoned(entry):
                    shutil.rmtree(entry, ignore_errors=True)
                    _lock_path(entry).unlink(missing_ok=True)
                    removed.append(entry)
                elif entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(LOCK_SUFFIX):
                    orphan = not entry.with_suffix("").exists() and _older_than_grace(entry)
                    if orphan and _is_abandoned_lock(entry):
                        entry.unlink(missing_ok=True)
        for path in removed:
            log.info("removed an interrupted write: %s", path)
        return removed


# --- helpers ------------------------------------------------------------------------------------


def _invalid_reason(folder: Path, kind: str, input_hash: str, verify: bool) -> str | None:
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        return "no manifest"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("schema_version") != SCHEMA_VERSION:
        return f"manifest schema {manifest.get('schema_version')} != {SCHEMA_VERSION}"
    if manifest.get("kind") != kind:
        return f"kind {manifest.get('kind')!r} != {kind!r}"
    if manifest.get("input_hash") != input_hash:
        return "input hash differs"
    outputs = manifest.get("outputs")
    if not isinstance(outputs, list) or not outputs:
        return "no outputs recorded"
    for output in outputs:
        path = folder / output["path"]
        if not path.is_file():
            return f"{output['path']} is missing"
        if path.stat().st_size != output.get("bytes"):
            return f"{output['path']} has another size"
        if verify and sha256_file(path) != output.get("sha256"):
            return f"{output['path']} has another sha256"
    return None


def _commit(writer: ArtifactWriter) -> None:
    clash = sorted(set(writer.manifest) & set(_RESERVED))
    if clash:
        raise ValueError(f"manifest keys {clash} are written by the store")
    outputs = []
    for path in sorted(p for p in writer.path.rglob("*") if p.is_file()):
        relative = path.relative_to(writer.path).as_posix()
        outputs.append({"path": relative, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    if not outputs:
        raise ValueError(f"{writer.kind} artifact {writer.name}: nothing was written")
    manifest = {
        "schema_version": SCHEMA_VERSION, "kind": writer.kind, "name": writer.name,
        "input_hash": writer.input_hash, "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "outputs": outputs, **writer.manifest,
    }
    _write_file_atomically(writer.path / MANIFEST_NAME, json.dumps(manifest, indent=2, default=str) + "\n")
    _replace_folder(writer.path, writer.final_path)


def _write_file_atomically(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())  # a unique temporary name: two writers never share one


def _replace_folder(source: Path, target: Path) -> None:
    """Rename `source` to `target`, moving aside an existing (invalid or concurrent) `target` first."""
    if target.exists():
        trash = target.with_name(f"{TRASH_PREFIX}{target.name}.{os.getpid()}.{time.monotonic_ns()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(source, target)
    with contextlib.suppress(OSError):  # durability of the rename; not available on every filesystem
        descriptor = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _lock_path(temp: Path) -> Path:
    return temp.with_name(temp.name + LOCK_SUFFIX)


def _hold_lock(path: Path):
    handle = open(path, "w")
    fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel when the process dies, however it dies
    return handle


def _release_lock(handle, path: Path) -> None:
    path.unlink(missing_ok=True)
    handle.close()


def _is_abandoned(temp: Path) -> bool:
    lock = _lock_path(temp)
    if not lock.exists():
        return _older_than_grace(temp)
    return _is_abandoned_lock(lock)


def _older_than_grace(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime > _UNLOCKED_GRACE_S
    except FileNotFoundError:
        return False


def _is_abandoned_lock(lock: Path) -> bool:
    try:
        with open(lock) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a live writer holds it
            fcntl.flock(handle, fcntl.LOCK_UN)
            return True
    except FileNotFoundError:
        return False
