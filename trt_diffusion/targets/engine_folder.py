"""An engine that is a folder: the skeleton and manifest base the onnxruntime and openvino targets share (and a
target a test defines at run time can use).

Layout: `<workspace>/engines/<target>/<spec.name>.<spec.key>/`, sealed by `manifest.json` — the fields of
`FolderEngineManifest` plus the target's own. A build fills a temporary folder beside its final place
(`.<name>.<key>.*`, what workspace/locks.clean_temporaries removes after a killed build), writes the manifest
last and renames the folder in, so an interrupted build leaves nothing a later run trusts. The manifest is
trusted only while the engine's bytes digest to what it records (workspace/manifests.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from ..onnx_facts import ProfileShapes, Shape
from ..tensors import TensorSpec
from ..workspace.manifests import (
    MANIFEST_FILE,
    read_folder_manifest,
    record_files,
    trusted_folder_manifest,
    verify_engine_folder,
)
from .base import BuiltEngine

if TYPE_CHECKING:
    from ..engines_file import EngineSpec


class FolderEngineManifest(BaseModel):
    """What every folder engine's manifest records; a target subclasses it with its own fields (and its name
    as `target`'s default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 1
    spec_key: str
    spec_name: str
    target: str
    input_hash: str  # what the engine was built from (`input_hash`): a changed input is a rebuild
    onnx_sha256: str  # the source ONNX
    engine_sha256: str  # the engine's own bytes, as the target digests them
    static_shapes: bool
    profile_shapes: dict[str, tuple[Shape, Shape, Shape]]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    build_seconds: float
    created_at: str
    file_sha256: dict[str, str] = {}  # every file of the folder but the manifest (empty in older manifests)


Manifest = TypeVar("Manifest", bound=FolderEngineManifest)


def input_hash(payload: Mapping[str, Any]) -> str:
    """The sha256 of what an engine is built from (source ONNX digest, spec key, tool versions, options)."""
    return hashlib.sha256(json.dumps(dict(payload), sort_keys=True).encode()).hexdigest()


def is_static(profile: ProfileShapes) -> bool:
    return all(lo == opt == hi for lo, opt, hi in profile.values())


@dataclass(frozen=True)
class EngineFolders(Generic[Manifest]):
    """One target's engine folders: its name, its manifest model and how its engine's bytes are digested
    (`unreadable`: the errors of that digest that mean "not an engine we built")."""

    target: str
    manifest: type[Manifest]
    engine_digest: Callable[[Path], str]
    unreadable: tuple[type[Exception], ...] = (OSError,)

    def folder(self, workspace: str | Path, spec: EngineSpec) -> Path:
        return Path(workspace) / "engines" / self.target / f"{spec.name}.{spec.key}"

    def read(self, folder: Path) -> Manifest | None:
        return read_folder_manifest(folder, self.manifest)

    def trusted(self, folder: Path, built_from: str) -> Manifest | None:
        """The manifest of a complete engine built from exactly these inputs (`built_from`, an `input_hash`)."""
        return trusted_folder_manifest(folder, built_from, self.manifest, self.engine_digest,
                                       unreadable=self.unreadable)

    def current(self, workspace: str | Path, spec: EngineSpec, built_from: str) -> tuple[Path, Manifest | None]:
        """The folder of `spec`'s engine, and its manifest when the engine there was built from exactly
        `built_from` (None: build it)."""
        folder = self.folder(workspace, spec)
        return folder, self.trusted(folder, built_from)

    def verify(self, folder: Path, manifest: Manifest, *, where: str, full: bool = True) -> None:
        """BuildError unless the folder holds the bytes its manifest records (manifests.verify_engine_folder)."""
        verify_engine_folder(folder, manifest, self.engine_digest, where=where, full=full, files=manifest.file_sha256)

    def find(self, workspace: Path, spec: EngineSpec) -> BuiltEngine | None:
        """The Target protocol's `find`: the engine whose manifest names this spec, its bytes checked (a cached
        verdict while the files are unchanged)."""
        folder = self.folder(workspace, spec)
        manifest = self.read(folder)
        if not manifest or manifest.spec_key != spec.key:
            return None
        self.verify(folder, manifest, where=spec.name, full=False)
        return BuiltEngine(spec, folder, manifest)

    def build(self, workspace: str | Path, spec: EngineSpec, built_from: str,
              make: Callable[[Path, Path, float], Manifest]) -> tuple[Path, Manifest, bool]:
        """The build skeleton every folder target shares: (folder, manifest, cached). The engine already built from
        exactly `built_from` is found; otherwise `make(staging, final, started)` fills a staging folder beside the
        final place and `seal`s it (returning the manifest), and a `make` that raises leaves nothing behind."""
        final, manifest = self.current(workspace, spec, built_from)
        if manifest is not None:
            return final, manifest, True
        started = time.perf_counter()
        with self.staging(final) as staging:
            manifest = make(staging, final, started)
        return final, manifest, False

    @contextlib.contextmanager
    def staging(self, final: Path) -> Iterator[Path]:
        """A temporary folder beside `final` to build the engine in; removed when the block raises (`seal`
        renames it into place)."""
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def seal(self, staging: Path, final: Path, *, spec: EngineSpec, built_from: str, onnx_sha256: str,
             profile: ProfileShapes, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
             started: float, **fields: Any) -> Manifest:
        """Write the manifest of the engine in `staging` (the common fields, then the target's `fields`) last,
        and rename the folder to `final` in place of what was there."""
        manifest = self.manifest(
            spec_key=spec.key, spec_name=spec.name, input_hash=built_from, onnx_sha256=onnx_sha256,
            engine_sha256=self.engine_digest(staging), static_shapes=is_static(profile),
            profile_shapes={k: tuple(map(tuple, v)) for k, v in profile.items()}, inputs=inputs, outputs=outputs,
            build_seconds=time.perf_counter() - started, created_at=datetime.now(UTC).isoformat(),
            file_sha256=record_files(staging), **fields)
        (staging / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        return manifest
