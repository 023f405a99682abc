"""An engine folder's manifest: read it, and trust it only while the engine's bytes are those it records.

Shared by the targets whose engine is a folder (onnxruntime, openvino); each names its manifest model and
how its engine's bytes are digested.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

MANIFEST_FILE = "manifest.json"
Manifest = TypeVar("Manifest", bound=BaseModel)


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
