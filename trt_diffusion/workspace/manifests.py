"""An engine folder's manifest: read it, and trust it only while the engine's bytes are those it records.

Shared by the targets whose engine is a folder (onnxruntime, openvino); each names its manifest model and
how its engine's bytes are digested.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from ..errors import BuildError
from .files import sha256_file
from .safe_paths import inside_folder, refuse_links

MANIFEST_FILE = "manifest.json"
Manifest = TypeVar("Manifest", bound=BaseModel)

# Verdicts of `verify_engine_folder(full=False)`: (folder, digest) -> the files' (name, inode, size, mtime_ns).
# A file rewritten in place changes its mtime (or size, or inode when renamed over): the verdict no longer
# applies and the bytes are read again. `full=True` (package, serve, engine load) always reads them.
_VERDICTS: dict[tuple[str, str], tuple] = {}
_VERDICTS_LOCK = threading.Lock()


def read_folder_manifest(folder: Path, model: type[Manifest]) -> Manifest | None:
    """The folder's manifest, or None when it is missing or does not parse as `model`."""
    try:
        return model.model_validate_json((Path(folder) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None


def trusted_folder_manifest(folder: Path, input_hash: str, model: type[Manifest],
                            engine_digest: Callable[[Path], str],
                            unreadable: tuple[type[Exception], ...] = (OSError,)) -> Manifest | None:
    """The manifest of a complete engine built from exactly these inputs (its `input_hash`) whose bytes still
    digest to its `engine_sha256`, else None: an engine whose files cannot be read is not one we built."""
    manifest = read_folder_manifest(folder, model)
    if manifest is None or getattr(manifest, "input_hash") != input_hash:
        return None
    try:
        if engine_digest(Path(folder)) != getattr(manifest, "engine_sha256"):
            return None
    except unreadable:
        return None
    return manifest


def record_files(folder: Path) -> dict[str, str]:
    """sha256 of every regular file of an engine folder but its manifest (what the manifest records), refusing
    symbolic links; names are plain file names (engine folders are flat)."""
    folder = Path(folder)
    refuse_links(folder, where=f"engine folder {folder}", error=BuildError)
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MANIFEST_FILE and not p.name.startswith(".")}


def _identity(folder: Path, names) -> tuple:
    rows = []
    for name in sorted(names):
        info = os.stat(folder / name, follow_symlinks=False)
        rows.append((name, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(rows)


def verify_engine_folder(folder: Path, manifest: BaseModel, engine_digest: Callable[[Path], str], *,
                         where: str, full: bool, files: Mapping[str, str] | None = None) -> None:
    """Raise BuildError unless the engine's bytes are those its manifest records: no symbolic link in the
    folder, `engine_digest(folder)` equal to `engine_sha256`, and each file of `files` (name -> sha256, the
    manifest's `file_sha256`) present with that digest. `full=False` accepts an earlier verdict on the very
    same files (inode, size, mtime_ns): `find()` and the no-op build stay cheap; package, serve and engine load
    pass `full=True`."""
    folder = Path(folder)
    refuse_links(folder, where=where, error=BuildError)
    files = dict(files or {})
    for name in files:
        path = inside_folder(folder, name, where=f"{where}: {folder / MANIFEST_FILE}", field="file_sha256",
                             error=BuildError, name_only=True)
        if not path.is_file():
            raise BuildError(f"{where}: {path} is missing (the manifest records it); rebuild the engine")
    seen = [p.name for p in folder.iterdir() if p.is_file()]
    key = (str(folder.resolve()), getattr(manifest, "engine_sha256"))
    identity = _identity(folder, seen)
    if not full:
        with _VERDICTS_LOCK:
            if _VERDICTS.get(key) == identity:
                return
    try:
        actual = engine_digest(folder)
    except (OSError, BuildError) as exc:
        raise BuildError(f"{where}: the engine in {folder} cannot be read ({exc}); rebuild it") from None
    if actual != getattr(manifest, "engine_sha256"):
        raise BuildError(f"{where}: the engine in {folder} does not match the engine_sha256 of its manifest "
                         "(changed after it was built); rebuild it")
    for name, digest in files.items():
        if sha256_file(folder / name) != digest:
            raise BuildError(f"{where}: {folder / name} does not match its sha256 in the manifest's file_sha256 "
                             "(changed after it was built); rebuild the engine")
    with _VERDICTS_LOCK:
        _VERDICTS[key] = identity
