"""The timing cache of a build: one file per GPU and full TensorRT version, used by one build at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from .versions import parse_trt_version


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


def timing_cache_path(cache_dir: str | Path, compute_capability: tuple[int, int], trt_version: str,
                      device_name: str) -> Path:
    """One timing cache per GPU (compute capability and device name) and full TensorRT version.

    `ITimingCache.combine` skips a cache from any other TensorRT build (it needs the exact version, build
    number included) and `set_timing_cache` rejects one timed on another device, so a cache shared across
    either would be replaced on every build: `sm89-nvidia-l40s-trt10.13.0.35.timing.cache`.
    """
    parse_trt_version(trt_version)  # refuse what is not a version
    cc_major, cc_minor = compute_capability
    return Path(cache_dir) / f"sm{cc_major}{cc_minor}-{_slug(device_name)}-trt{_slug(str(trt_version))}.timing.cache"


_CACHE_LOCKS_GUARD = threading.Lock()
_CACHE_LOCKS: dict[str, threading.Lock] = {}


def _thread_lock_for(path: Path) -> threading.Lock:
    key = os.path.realpath(path)
    with _CACHE_LOCKS_GUARD:
        return _CACHE_LOCKS.setdefault(key, threading.Lock())


@contextlib.contextmanager
def timing_cache_lock(cache_path: str | Path) -> Iterator[None]:
    """Exclusive use of one timing cache file: threads of this process (`build --jobs N` runs threads) and
    other processes alike.

    Polygraphy's LockFile takes `fcntl.lockf`, a POSIX record lock: it belongs to the process, so a second
    thread of the same process "acquires" it at once. `flock` on a file opened per call excludes threads
    on a local Linux file system, but not where flock is emulated with record locks (NFS). So the
    in-process lock is taken first, then `flock` on `<cache>.lock` for other processes.
    """
    path = Path(cache_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _thread_lock_for(path):
        with open(path.with_name(path.name + ".lock"), "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
