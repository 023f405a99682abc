"""One builder per engine at a time, across threads, processes and hosts sharing a workspace.

`<workspace>/locks/<key>.lock` is created with O_EXCL and holds who took it (host, pid, time). Its holder
touches it while it builds (a heartbeat); a lock is stale when its holder is a dead process on this host,
or when nobody has touched it for `stale_after_s` (a builder on another host that died). A stale lock is
broken by renaming it aside first, so two waiters cannot both break it and both build. A waiter that
gets the lock re-checks whether the engine is now current: the other builder's result is reused, not
rebuilt.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STALE_AFTER_S = 600.0  # no heartbeat for this long: the holder is gone
HEARTBEAT_S = 10.0
POLL_S = 0.2
CLOCK_SKEW_S = 120.0  # hosts sharing a workspace may disagree on the time by this much


@contextmanager
def heartbeat(touch: Callable[[], None], every_s: float, name: str) -> Iterator[None]:
    """Call `touch()` every `every_s` seconds from a daemon thread while the block runs (a lock's proof of
    life); an exception from `touch` ends the beating, and the thread is joined when the block ends."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                touch()
            except Exception:  # noqa: BLE001 - a lost heartbeat only lets the lock go stale
                return

    beater = threading.Thread(target=beat, name=name, daemon=True)
    beater.start()
    try:
        yield
    finally:
        stop.set()
        beater.join()


def lock_path(workspace: Path, key: str) -> Path:
    return Path(workspace) / "locks" / f"{key}.lock"


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "thread": threading.get_ident(), "since": time.time()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_temporaries(workspace: Path, name: str, key: str) -> list[Path]:
    """Remove what killed builds of one engine left beside it; call it holding that engine's lock.

    A build writes into `engines/<target>/.<name>.<key>.*` first: a `mkdtemp` folder (onnxruntime, openvino)
    or a `*.tmp` file (tensorrt's plan and manifest, written by `atomic_write_bytes`). Only a builder or a
    refit of this key makes them, and both hold the key's lock, so while it is held every one of them is
    dead. Other names (a remote pull's `.pull.` files, other keys) are left alone."""
    prefix = f".{name}.{key}."
    removed = []
    for folder in sorted((Path(workspace) / "engines").glob("*/")):
        for entry in sorted(folder.glob(f"{glob.escape(prefix)}*")):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.endswith(".tmp"):
                entry.unlink(missing_ok=True)
            else:
                continue
            removed.append(entry)
    return removed


def is_stale(path: Path, stale_after_s: float = STALE_AFTER_S, now: float | None = None) -> bool:
    """A lock whose holder died on this host, or that no holder has touched for `stale_after_s`."""
    try:
        touched = path.stat().st_mtime
        holder = json.loads(path.read_text())
    except OSError:
        return False  # just removed: look again
    except (ValueError, RecursionError):
        holder = None  # being written, or not a lock: its age decides
    now = time.time() if now is None else now
    pid = holder.get("pid") if isinstance(holder, dict) else None
    if isinstance(holder, dict) and holder.get("host") == socket.gethostname() and type(pid) is int and pid > 0 \
            and not _alive(pid):
        return True
    age = now - touched
    # touched in the future beyond clock skew (a planted `touch -d 2100-01-01`): not a heartbeat, stale
    return age > stale_after_s or age < -CLOCK_SKEW_S


def _try_create(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump(_holder(), handle)
    return True


def _break(path: Path) -> None:
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(path, aside)  # only one waiter wins this rename
    except OSError:
        return
    aside.unlink(missing_ok=True)


@contextmanager
def engine_lock(workspace: Path, key: str, *, stale_after_s: float = STALE_AFTER_S,
                heartbeat_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Hold the build lock of one engine key for the duration of the block (waiting while another holds it)."""
    path = lock_path(workspace, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    while not _try_create(path):
        if is_stale(path, stale_after_s):
            _break(path)
        else:
            time.sleep(POLL_S)
    try:
        with heartbeat(lambda: os.utime(path), heartbeat_s, f"lock-heartbeat-{key}"):
            yield
    finally:
        path.unlink(missing_ok=True)
