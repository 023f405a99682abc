"""File mechanics every stage shares: one atomic write, one staged folder, one sha256, one stat verdict, one list of tool versions per
purpose.

An artifact is written to a unique temporary name beside its place, flushed to disk and renamed, so a reader
(or a later run) never sees half a file; a hash is read in chunks, never the whole file at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

CHUNK_BYTES = 8 << 20


def sha256_file(path: str | os.PathLike, chunk_size: int = CHUNK_BYTES) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def update_digest(digest: Any, path: str | os.PathLike, chunk_size: int = CHUNK_BYTES) -> None:
    """Feed a file into a running hash (several files under one digest)."""
    with open(path, "rb") as handle:
        while block := handle.read(chunk_size):
            digest.update(block)


def stat_rows(path: str | Path) -> list[list]:
    """[name, inode, size, mtime_ns] of a file, or of every file under a folder (hidden ones left out); a missing
    path is one row of -1s. What the no-op build and export compare instead of hashing: a file rewritten in place
    changes its mtime, one renamed over changes its inode (make's, ninja's and git's index's verdict)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    else:
        return [[str(path), -1, -1, -1]]
    rows = []
    for file in files:
        stat = file.stat()
        rows.append([str(file), stat.st_ino, stat.st_size, stat.st_mtime_ns])
    return rows


def atomic_write_bytes(path: str | Path, data: Any) -> None:
    """Write to a temporary name beside `path`, then rename: readers never see half a file.
    `data` may be bytes or any buffer (TensorRT's IHostMemory included)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(memoryview(data))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


# The installed packages an artifact records, by what records them: one list per purpose, kept here only.
# "export": what changes an ONNX export (its artifact key); "quantize": a Q/DQ artifact's calibration and export;
# "build": what changes an engine (the no-op build's fingerprint); "provenance": who built a release's engines
# and with what; "parity": what shapes a parity report's numbers.
_ENGINE_TOOLS = ("trt-diffusion", "torch", "diffusers", "transformers", "peft", "onnx", "onnxruntime",
                 "nvidia-modelopt", "tensorrt", "openvino")
TOOL_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "export": ("trt-diffusion", "torch", "diffusers", "transformers", "peft", "onnx", "onnxscript",
               "onnx-graphsurgeon"),
    "quantize": ("trt-diffusion", "torch", "diffusers", "transformers", "onnx", "nvidia-modelopt"),
    "build": _ENGINE_TOOLS,
    "provenance": _ENGINE_TOOLS,
    "parity": (*_ENGINE_TOOLS, "numpy", "scikit-image", "lpips"),
}


@contextmanager
def staged_folder(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of `out` to fill; renamed over `out` (replacing a folder there) when the block ends,
    removed if it raises: an interrupted writer never leaves half a folder at `out`. Callers decide beforehand
    whether an existing `out` may be replaced."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def tool_versions(purpose: str) -> dict[str, str | None]:
    """{distribution: installed version, or None where it is not installed} for one purpose's list."""
    versions: dict[str, str | None] = {}
    for name in TOOL_DISTRIBUTIONS[purpose]:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
