"""A store written by other hosts is input (issue 32, findings 2 and 10): a record writes only its own unit,
never the cache's state, another unit or a lock; empty/dot paths and malformed records are one StoreError;
a lock touched in the future is stale; a blob overwritten with other bytes of the same size is repaired by
the next publish. Against an S3-protocol server on loopback (moto_server) and real local locks."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("s3fs", reason="the S3 backend is an extra: pip install 'trt-diffusion[store]'")

from trt_diffusion.workspace import locks  # noqa: E402
from trt_diffusion.workspace.files import sha256_file  # noqa: E402
from trt_diffusion.workspace.remote_store import RemoteStore, StoreError  # noqa: E402

BUCKET = "trt-trust"
UNIT = "engines/onnxruntime/a.0123456789abcdef"


def _hostile_record(s3, store: RemoteStore, unit: str, files: dict[str, bytes], **extra) -> None:
    """What a compromised build host can do: put blobs and a record of its choosing."""
    entries = {}
    for relative, data in files.items():
        import hashlib

        sha = hashlib.sha256(data).hexdigest()
        s3.pipe_file(store.blob_key(sha), data)
        entries[relative] = {"sha256": sha, "bytes": len(data)}
    record = {"schema_version": 1, "unit": unit, "key": "0123456789abcdef", "files": entries, **extra}
    s3.pipe_file(store.index_key(unit), json.dumps(record).encode())


def _victim(tmp_path):
    cache = tmp_path / "victim"
    other = cache / "engines" / "onnxruntime" / "b.fedcba9876543210"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text('{"mine": true}')
    (cache / ".build-state.json").write_text('{"mine": true}')
    (cache / "locks").mkdir()
    (cache / "locks" / "fedcba9876543210.lock").write_text('{"mine": true}')
    return cache


def _cache_files(cache: Path) -> dict[str, bytes]:
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in cache.rglob("*")
            if p.is_file() and p.name != ".store-state.json"}


@pytest.mark.parametrize("relative", [
    "engines/onnxruntime/b.fedcba9876543210/manifest.json",  # another unit's manifest
    ".store-state.json", ".build-state.json",  # the cache's own state
    "locks/fedcba9876543210.lock",  # another key's lock
    "provenance/fedcba9876543210.json",  # another key's provenance
    "", ".", f"{UNIT}/./model.onnx", f"{UNIT}//model.onnx",  # empty / dot paths
])
def test_a_record_writes_only_its_own_unit(tmp_path, s3, relative):
    cache = _victim(tmp_path)
    before = _cache_files(cache)
    store = RemoteStore(f"s3://{BUCKET}/ws", cache)
    _hostile_record(s3, store, UNIT, {f"{UNIT}/model.onnx": b"engine", relative: b"attacker bytes"})
    with pytest.raises(StoreError, match=r"the record of engines/onnxruntime/a\.0123456789abcdef"):
        store.pull(UNIT)
    assert _cache_files(cache) == before  # nothing written, nothing left beside the cache
    assert not [p for p in cache.rglob("*.pull.*")]


@pytest.mark.parametrize("record", [
    [1, 2], "text", {"schema_version": 1, "unit": UNIT, "files": [1]},
    {"schema_version": 1, "unit": UNIT, "files": {f"{UNIT}/model.onnx": "abc"}},
    {"schema_version": 1, "unit": UNIT, "files": {f"{UNIT}/model.onnx": {"sha256": "x", "bytes": "1"}}},
    {"schema_version": 1, "unit": UNIT, "files": {f"{UNIT}/model.onnx": {"sha256": "0" * 64, "bytes": 1.5}}},
])
def test_a_malformed_record_is_one_store_error(tmp_path, s3, record):
    store = RemoteStore(f"s3://{BUCKET}/ws", tmp_path / "cache")
    s3.pipe_file(store.index_key(UNIT), json.dumps(record).encode())
    with pytest.raises(StoreError, match=r"the record of"):
        store.pull(UNIT)
    s3.pipe_file(store.index_key(UNIT), b"[" * 100_000)  # deep nesting
    with pytest.raises(StoreError, match="not JSON"):
        store.pull(UNIT)


def test_a_plan_unit_may_name_its_same_stem_siblings_and_provenance(tmp_path, s3):
    unit = "engines/tensorrt/unet.0123456789abcdef.plan"
    store = RemoteStore(f"s3://{BUCKET}/ws", tmp_path / "cache")
    _hostile_record(s3, store, unit, {unit: b"plan", "engines/tensorrt/unet.0123456789abcdef.manifest.json": b"{}",
                                      "provenance/0123456789abcdef.json": b"{}"})
    assert store.pull(unit)
    _hostile_record(s3, store, unit, {unit: b"plan", "engines/tensorrt/vae.fedcba9876543210.plan": b"x"})
    with pytest.raises(StoreError, match="outside the unit"):
        store.pull(unit)


# --- finding 10: locks and blobs


def test_a_remote_lock_touched_in_the_future_is_stale(tmp_path, s3):
    store = RemoteStore(f"s3://{BUCKET}/ws", tmp_path / "cache")
    for body in ({"host": "h", "pid": 1, "token": "t", "touched": 1e18}, {"host": "h", "touched": "abc"},
                 {"host": "h", "touched": float("nan")}, [1], "x"):
        s3.pipe_file(store.lock_key("k"), json.dumps(body).encode())
        with store.lock("k", stale_after_s=600):  # taken, not waited for
            assert json.loads(s3.cat_file(store.lock_key("k")))["host"] == socket.gethostname()


def test_a_local_lock_touched_in_the_future_is_stale(tmp_path):
    path = locks.lock_path(tmp_path, "k")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    future = time.time() + 10 ** 9
    os.utime(path, (future, future))
    assert locks.is_stale(path)
    path.write_text("[1]")  # not a lock body: no traceback, its age decides
    os.utime(path, (future, future))
    assert locks.is_stale(path)
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": "abc"}))
    assert not locks.is_stale(path)  # fresh, and no pid to check


def test_a_same_size_overwritten_blob_is_repaired_by_the_next_publish(tmp_path, s3):
    cache = tmp_path / "cache"
    folder = cache / UNIT
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"engine bytes" * 100)
    (folder / "manifest.json").write_text("{}")
    store = RemoteStore(f"s3://{BUCKET}/ws", cache)
    assert store.publish(UNIT, folder.iterdir(), key="0123456789abcdef")
    sha = sha256_file(folder / "model.onnx")
    s3.pipe_file(store.blob_key(sha), b"X" * 1200)  # same size, other bytes
    s3.rm_file(store.index_key(UNIT))  # the record is published again (e.g. a rebuild)
    assert store.publish(UNIT, folder.iterdir(), key="0123456789abcdef")
    assert s3.cat_file(store.blob_key(sha)) == b"engine bytes" * 100
