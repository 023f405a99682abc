"""What the stages call around a URL workspace's store (remote_store.py): source artifacts pulled before an
export or build and published after it, an engine pulled before its build (another host's is reused) and
published with its provenance after, engines pulled before they are served, and the store's lock of one engine
key across hosts. Each is a no-op for a folder workspace (a path or a file:// URL), whose lock files
(locks.py) already serialise builds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from .remote_store import SOURCE_KINDS, RemoteStore, unit_spec_key
from .urls import is_remote

_stores: dict[tuple[str, str], RemoteStore] = {}
_stores_lock = threading.Lock()


def store_for(config) -> RemoteStore | None:
    """The remote store behind engines.yaml's workspace, or None when the workspace is a folder."""
    url = config.build.workspace
    if not is_remote(url):
        return None
    cache = Path(config.workspace)
    with _stores_lock:
        if (url, str(cache)) not in _stores:
            cache.mkdir(parents=True, exist_ok=True)
            _stores[(url, str(cache))] = RemoteStore(url, cache)
        return _stores[(url, str(cache))]


def source_units(cache: Path) -> list[str]:
    """The committed source artifacts in the cache: `<kind>/<name>.<key>` folders holding a manifest."""
    units = []
    for kind in SOURCE_KINDS:
        folder = Path(cache) / kind
        if folder.is_dir():
            units += [f"{kind}/{p.name}" for p in sorted(folder.iterdir())
                      if p.is_dir() and not p.name.startswith(".") and (p / "manifest.json").is_file()]
    return units


def pull_sources(config) -> int:
    """Bring every source artifact (ONNX exports, Q/DQ ONNX, calibration) the store holds into the cache."""
    store = store_for(config)
    if store is None:
        return 0
    units = [u for kind in SOURCE_KINDS for u in store.units(kind)]
    return sum(store.pull(u) for u in units)


def publish_sources(config) -> int:
    store = store_for(config)
    if store is None:
        return 0
    published = 0
    for unit in source_units(store.cache):
        files = [p for p in (store.cache / unit).rglob("*") if p.is_file()]
        published += store.publish(unit, files)
    return published


def engine_unit(store: RemoteStore, path: Path) -> str:
    return store._relative(path)


def publish_engine(config, spec, path: Path) -> bool:
    """Publish an engine's files and its provenance record as one unit (no-op for a folder workspace)."""
    store = store_for(config)
    if store is None:
        return False
    from .provenance import engine_files, provenance_path

    files = list(engine_files(Path(path)))
    record = provenance_path(store.cache, spec.key)
    if record.is_file():
        files.append(record)
    return store.publish(engine_unit(store, Path(path)), files, key=spec.key)


def pull_engines(config, keys: Iterable[str]) -> int:
    """Pull the engines (and provenance) of these spec keys that the store holds."""
    store = store_for(config)
    if store is None:
        return 0
    wanted = set(keys)
    pulled = 0
    for unit in store.units("engines"):
        if unit.rsplit(".", 1)[-1] in wanted or unit_spec_key(unit) in wanted:
            pulled += store.pull(unit)
    return pulled


@contextlib.contextmanager
def engine_lock(config, key: str) -> Iterator[None]:
    """The store's lock of one engine key across hosts (a no-op for a folder workspace, whose lock files do it)."""
    store = store_for(config)
    if store is None:
        yield
        return
    with store.lock(key):
        yield
