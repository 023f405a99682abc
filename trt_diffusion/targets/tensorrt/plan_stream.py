"""Streamed plan loading: host RAM near one chunk, not one whole plan (plus TensorRT's copy) per load.

`Runtime.deserialize_cuda_engine(bytes)` needs the plan in host memory while TensorRT builds the engine from it,
so loading a 24 GB FLUX plan peaks near two copies. With an `IStreamReaderV2` TensorRT pulls the plan in chunks.
The plan's sha256 is still checked before TensorRT sees a byte (plan_trust.py): the file is opened once, hashed
through that open handle, and streamed from the same handle (a rename-based replacement cannot change what it
reads); the chunks are hashed again as TensorRT reads them and the engine is discarded if they differ (an in-place
overwrite between the passes). A plan that would run host code (version-compatible) is streamed only when no one
but this user can write it; otherwise it is loaded from memory, verified bytes and all.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ...errors import BuildError
from .manifest import EngineManifest
from .plan_trust import digest_problem

if TYPE_CHECKING:
    import tensorrt as trt

CHUNK_BYTES = 64 << 20
STREAM_THRESHOLD_BYTES = 1 << 30  # plans at least this large are streamed (where allowed)


def privately_writable(path: str | Path) -> bool:
    """True when only this user (or root) can write the file: nobody else can change it between two reads."""
    info = os.stat(path)
    return info.st_uid in (os.getuid(), 0) and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def load_mode(plan_bytes: int, host_code: bool, private: bool, threshold: int = STREAM_THRESHOLD_BYTES) -> str:
    """"stream" or "memory": stream large plans, except a host-code plan others could rewrite between passes."""
    if plan_bytes < threshold:
        return "memory"
    return "memory" if host_code and not private else "stream"


def open_verified(path: str | Path, manifest: EngineManifest, *, for_refit: bool = False) -> tuple[IO[bytes], str]:
    """The plan opened and hashed through the handle (in chunks); BuildError before TensorRT sees it unless the
    digest is the manifest's. The handle is left at offset 0 for streaming."""
    handle = open(path, "rb", buffering=0)  # unbuffered: the second pass reads the file, not a stale buffer
    try:
        digest = hashlib.sha256()
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(block)
        problem = digest_problem(manifest, digest.hexdigest(), f"engine plan {path}", for_refit=for_refit)
        if problem:
            raise BuildError(problem)
        handle.seek(0)
        return handle, digest.hexdigest()
    except BaseException:
        handle.close()
        raise


class ChunkSource:
    """What the stream reader reads from: the open plan, hashing every byte handed out (in order)."""

    def __init__(self, handle: IO[bytes], chunk_bytes: int | None = None):
        self.handle, self.chunk_bytes = handle, chunk_bytes or CHUNK_BYTES
        self.digest = hashlib.sha256()
        self.hashed_to = 0  # bytes hashed so far (only a forward, contiguous read is hashed)
        self.largest_read = 0

    def read(self, num_bytes: int) -> bytes:
        position = self.handle.tell()
        data = self.handle.read(min(num_bytes, self.chunk_bytes))
        if position == self.hashed_to:
            self.digest.update(data)
            self.hashed_to += len(data)
        self.largest_read = max(self.largest_read, len(data))
        return data

    def seek(self, offset: int, whence: int) -> bool:
        try:
            self.handle.seek(offset, whence)
        except (OSError, ValueError):
            return False
        return True

    def verdict(self, expected: str, total: int) -> bool:
        """True when TensorRT read the whole plan once front to back and it hashed to `expected`."""
        return self.hashed_to == total and self.digest.hexdigest() == expected


def stream_reader(source: ChunkSource) -> trt.IStreamReaderV2:
    """An `IStreamReaderV2` over `source`. The binding calls the Python `read(num_bytes, stream)` and copies the
    buffer it returns (python/src/infer/pyCore.cpp, PyStreamReaderV2::read, release/11.1): the stub's C++-shaped
    signature (destination, num_bytes, stream) is not what Python implements, hence the one ignore below."""
    import tensorrt as trt

    whence = {trt.SeekPosition.SET: os.SEEK_SET, trt.SeekPosition.CUR: os.SEEK_CUR,
              trt.SeekPosition.END: os.SEEK_END}

    class PlanReader(trt.IStreamReaderV2):
        def __init__(self) -> None:
            trt.IStreamReaderV2.__init__(self)

        def read(self, num_bytes: int, stream: int) -> bytes:  # type: ignore[override]
            return source.read(num_bytes)

        def seek(self, offset: int, where: trt.SeekPosition) -> bool:
            return source.seek(offset, whence[where])

    return PlanReader()
