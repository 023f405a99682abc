"""Streamed plan loading: host RAM near one chunk, not one whole plan (plus TensorRT's copy) per load.

`Runtime.deserialize_cuda_engine(bytes)` needs the plan in host memory while TensorRT builds the engine from it,
so loading a 24 GB FLUX plan peaks near two copies. With an `IStreamReaderV2` TensorRT pulls the plan in chunks.
The plan's sha256 is still checked before TensorRT sees a byte (plan_trust.py): the file is opened once, hashed
through that open handle, and streamed from the same handle (a rename-based replacement cannot change what it
reads). The first pass also keeps the sha256 of every chunk; the second hands TensorRT bytes only from a chunk read
again whole and matching its digest, wherever TensorRT reads or seeks (nothing guarantees one pass front to back:
the reader exposes `seek`), and the engine is discarded if a chunk differs (an in-place overwrite between the
passes). A plan that would run host code (version-compatible) is streamed only when no one but this user can write
it; otherwise it is loaded from memory, verified bytes and all.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
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


@dataclass
class VerifiedPlan:
    """A plan opened once and hashed through that handle: its sha256, the sha256 of each chunk, its size."""

    handle: IO[bytes]
    sha256: str
    chunk_digests: list[bytes]
    size: int

    def source(self) -> ChunkSource:
        return ChunkSource(self.handle, self.chunk_digests, self.size)


def open_verified(path: str | Path, manifest: EngineManifest, *, for_refit: bool = False) -> VerifiedPlan:
    """The plan opened and hashed through the handle (in chunks); BuildError before TensorRT sees it unless the
    sha256 is the manifest's. The handle is left at offset 0; the caller closes it."""
    handle = open(path, "rb", buffering=0)  # unbuffered: the second pass reads the file, not a stale buffer
    try:
        digest, chunks, size = hashlib.sha256(), [], 0
        while block := _read_chunk(handle, CHUNK_BYTES):
            digest.update(block)
            chunks.append(hashlib.sha256(block).digest())
            size += len(block)
        problem = digest_problem(manifest, digest.hexdigest(), f"engine plan {path}", for_refit=for_refit)
        if problem:
            raise BuildError(problem)
        handle.seek(0)
        return VerifiedPlan(handle, digest.hexdigest(), chunks, size)
    except BaseException:
        handle.close()
        raise


def _read_chunk(handle: IO[bytes], size: int) -> bytes:
    """`size` bytes, fewer only at the end of the file (an unbuffered read may return less than asked)."""
    parts, wanted = [], size
    while wanted > 0:
        part = handle.read(wanted)
        if not part:
            break
        parts.append(part)
        wanted -= len(part)
    return b"".join(parts)


class ChunkSource:
    """What the stream reader reads from: the open plan, handed out only from chunks read whole and matching the
    digest the first pass took of them, at whatever position TensorRT reads or seeks to. One chunk is held."""

    def __init__(self, handle: IO[bytes], chunk_digests: list[bytes], total: int, chunk_bytes: int | None = None):
        self.handle, self.chunk_digests, self.total = handle, chunk_digests, total
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self.position = 0
        self.changed = False  # a chunk read again did not match: nothing more is handed out
        self.largest_read = 0
        self._index, self._chunk = -1, b""

    def _chunk_at(self, index: int) -> bytes | None:
        if index != self._index:
            self.handle.seek(index * self.chunk_bytes)
            data = _read_chunk(self.handle, self.chunk_bytes)
            if index >= len(self.chunk_digests) or hashlib.sha256(data).digest() != self.chunk_digests[index]:
                self.changed = True
                return None
            self._index, self._chunk = index, data
        return self._chunk

    def read(self, num_bytes: int) -> bytes:
        """Up to `num_bytes` (at most one chunk's worth) from the current position; b"" at the end or once changed."""
        wanted, parts = min(num_bytes, self.chunk_bytes), []
        while wanted > 0 and not self.changed and self.position < self.total:
            index, offset = divmod(self.position, self.chunk_bytes)
            chunk = self._chunk_at(index)
            if chunk is None:
                return b""
            part = chunk[offset:offset + wanted]
            if not part:
                break
            parts.append(part)
            self.position += len(part)
            wanted -= len(part)
        data = b"".join(parts)
        self.largest_read = max(self.largest_read, len(data))
        return data

    def seek(self, offset: int, whence: int) -> bool:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.total}.get(whence)
        if base is None or not 0 <= base + offset <= self.total:
            return False
        self.position = base + offset
        return True

    def verdict(self) -> bool:
        """True when every byte handed to TensorRT came from a chunk that matched the verified plan."""
        return not self.changed


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
