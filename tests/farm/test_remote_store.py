"""build.workspace as a URL: an S3-protocol server on loopback started by the test (moto_server; docs/farm.md), and a
shared directory (file://). Build hosts publish into the store, a fresh host (its own empty cache) builds
nothing and packages what they made; a pull verifies every file against its record, and nothing the store does
not vouch for is trusted; two hosts publishing one unit leave one whole record; a stale lock object expires."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("s3fs", reason="the S3 backend is an extra: pip install 'trt-diffusion[store]'")

from shard_split import build_shards, two_host_shards  # noqa: E402

from trt_diffusion import api  # noqa: E402
from trt_diffusion.engines_file import load_engines_file  # noqa: E402
from trt_diffusion.errors import ConfigError, MissingDependencyError  # noqa: E402
from trt_diffusion.workspace.files import sha256_file  # noqa: E402
from trt_diffusion.workspace.provenance import engine_files  # noqa: E402
from trt_diffusion.workspace.remote_store import RemoteStore, StoreError  # noqa: E402
from trt_diffusion.workspace.store_sync import store_for  # noqa: E402
from trt_diffusion.workspace.urls import local_workspace, mask_url  # noqa: E402

BUCKET = "trt-farm"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _host_config(tmp_path: Path, built_sd15: Path, host: str, workspace: str, *, with_exports: bool = False) -> Path:
    """engines.yaml of the tiny model on a 'host': its own folder and cache, the shared workspace URL."""
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = workspace
    data["build"]["cache"] = str(tmp_path / host / "cache")
    folder = tmp_path / host
    folder.mkdir(parents=True, exist_ok=True)
    if with_exports:  # the exports verified once for the session: this host exported already
        shutil.copytree(built_sd15.parent / "build" / "onnx", folder / "cache" / "onnx")
    path = folder / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _engine_digests(outcomes) -> dict:
    return {o.spec.key: {f.name: sha256_file(f) for f in engine_files(o.path) if "manifest" not in f.name}
            for o in outcomes}


# --- the whole flow ---------------------------------------------------------------------------------


def test_build_hosts_publish_and_a_fresh_host_builds_nothing_and_packages_what_they_made(tmp_path, built_sd15, s3):
    url = f"s3://{BUCKET}/release-1"
    first = _host_config(tmp_path, built_sd15, "build-a", url, with_exports=True)
    second = _host_config(tmp_path, built_sd15, "build-b", url)
    first_shards, second_shards = two_host_shards(first)
    a = build_shards(first, first_shards)
    b = build_shards(second, second_shards)  # starts with an empty cache: pulls the exports host a published
    assert not a.failed and not b.failed and a.built and b.built
    assert len(list((tmp_path / "build-b" / "cache" / "onnx").iterdir())) == 4  # pulled, verified, not exported

    units = set(store_for(load_engines_file(first)).units())
    assert sum(u.startswith("onnx/") for u in units) == 4
    assert sum(u.startswith("engines/onnxruntime/") for u in units) == 4
    record = json.loads(s3.cat_file(f"{BUCKET}/release-1/index/{sorted(u for u in units if 'engines' in u)[0]}.json"))
    assert any(path.startswith("provenance/") for path in record["files"])  # provenance travels with its engine

    serving = _host_config(tmp_path, built_sd15, "serve", url)
    final = api.build(serving)  # nothing built: every engine came from the store, verified
    assert not final.failed and not final.built and len(final.cached) == 4
    local = api.build(built_sd15)
    assert _engine_digests(final.outcomes) == _engine_digests(local.outcomes)

    fresh = _host_config(tmp_path, built_sd15, "release", url)
    manifest = api.manifest(fresh)  # pulls the engines and their provenance, verifies every sha256
    assert manifest["counts"] == {"ok": 4, "modified": 0, "unrecorded": 0, "missing": 0}
    assert {e["built_by"]["host"] for e in manifest["engines"]} == {socket.gethostname()}

    from trt_diffusion.triton.stage import package_stage

    packager = _host_config(tmp_path, built_sd15, "packager", url)
    report = package_stage(packager, tmp_path / "triton_repo")
    assert (tmp_path / "triton_repo").is_dir() and report is not None
    assert (tmp_path / "packager" / "cache" / "engines" / "onnxruntime").is_dir()  # pulled, not built
    assert not (tmp_path / "packager" / "cache" / "onnx").exists()  # a serving host needs no exports


def test_a_damaged_blob_is_refused_on_pull_and_nothing_reaches_the_cache(tmp_path, s3):
    cache_a, cache_b = tmp_path / "a", tmp_path / "b"
    folder = cache_a / "engines" / "onnxruntime" / "m.0123456789abcdef"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"engine bytes" * 100)
    (folder / "manifest.json").write_text("{}")
    store = RemoteStore(f"s3://{BUCKET}/ws", cache_a)
    unit = "engines/onnxruntime/m.0123456789abcdef"
    assert store.publish(unit, folder.iterdir(), key="0123456789abcdef")
    assert not store.publish(unit, folder.iterdir(), key="0123456789abcdef")  # already there: nothing uploaded

    sha = sha256_file(folder / "model.onnx")
    s3.pipe_file(store.blob_key(sha), b"tampered" * 150)  # another content under the blob's name
    reader = RemoteStore(f"s3://{BUCKET}/ws", cache_b)
    with pytest.raises(StoreError, match="damaged"):
        reader.pull(unit)
    assert not (cache_b / unit / "model.onnx").exists() and not (cache_b / unit / "manifest.json").exists()
    assert not [p for p in cache_b.rglob("*") if p.is_file() and p.name != ".store-state.json"]

    s3.rm_file(store.blob_key(sha))  # a record naming content the store lacks
    with pytest.raises(StoreError, match="not in the store"):
        reader.pull(unit)

    # only what a record names is trusted: files put beside the records are never pulled
    s3.pipe_file(f"{BUCKET}/ws/engines/onnxruntime/x.fedcba9876543210/model.onnx", b"stray")
    assert reader.units("engines") == [unit]


def test_a_pull_brings_the_cache_to_the_record_and_keeps_files_that_match(tmp_path, s3):
    cache_a, cache_b = tmp_path / "a", tmp_path / "b"
    folder = cache_a / "onnx" / "g.00000000000000aa"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"graph")
    (folder / "manifest.json").write_text('{"v": 1}')
    RemoteStore(f"s3://{BUCKET}/ws", cache_a).publish("onnx/g.00000000000000aa", folder.iterdir())
    reader = RemoteStore(f"s3://{BUCKET}/ws", cache_b)
    assert reader.pull("onnx/g.00000000000000aa")
    assert (cache_b / "onnx/g.00000000000000aa/model.onnx").read_bytes() == b"graph"
    assert not reader.pull("onnx/g.00000000000000aa")  # already the record's files
    (cache_b / "onnx/g.00000000000000aa/model.onnx").write_bytes(b"changed here")
    assert reader.pull("onnx/g.00000000000000aa")  # the store's version wins
    assert (cache_b / "onnx/g.00000000000000aa/model.onnx").read_bytes() == b"graph"
    with pytest.raises(StoreError, match="not a path in the workspace"):
        reader.pull("bad", {"files": {"../../etc/x": {"sha256": "0" * 64, "bytes": 1}}})


def test_two_hosts_publishing_one_key_at_once_leave_one_whole_record(tmp_path, s3):
    """Builds need not be bit-identical across hosts (TensorRT): each publisher's files differ, and the record
    that lands names only its own blobs, so a pull gets one host's engine whole, never a mix."""
    unit = "engines/tensorrt/unet.1111111111111111.plan"
    stores = []
    for host in range(4):
        cache = tmp_path / f"host{host}"
        plan = cache / "engines" / "tensorrt" / "unet.1111111111111111.plan"
        plan.parent.mkdir(parents=True)
        plan.write_bytes(os.urandom(200_000))
        (plan.parent / "unet.1111111111111111.manifest.json").write_text(json.dumps({"host": host}))
        stores.append((RemoteStore(f"s3://{BUCKET}/ws", cache), [plan, plan.parent / "unet.1111111111111111.manifest.json"]))
    barrier = threading.Barrier(len(stores))
    errors = []

    def publish(store, files):
        try:
            barrier.wait()
            store.publish(unit, files, key="1111111111111111")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=pair) for pair in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    reader = RemoteStore(f"s3://{BUCKET}/ws", tmp_path / "reader")
    assert reader.pull(unit)
    pulled = tmp_path / "reader" / "engines" / "tensorrt"
    host = json.loads((pulled / "unet.1111111111111111.manifest.json").read_text())["host"]
    original = tmp_path / f"host{host}" / "engines" / "tensorrt" / "unet.1111111111111111.plan"
    assert (pulled / "unet.1111111111111111.plan").read_bytes() == original.read_bytes()


# --- locks ---------------------------------------------------------------------------------------


def test_the_store_lock_is_exclusive_and_a_stale_one_expires(tmp_path, s3):
    store = RemoteStore(f"s3://{BUCKET}/ws", tmp_path / "cache")
    other = RemoteStore(f"s3://{BUCKET}/ws", tmp_path / "other")
    order = []
    inside = threading.Event()

    def second():
        inside.wait()
        with other.lock("k", heartbeat_s=0.2):
            order.append("second")

    thread = threading.Thread(target=second)
    thread.start()
    with store.lock("k", heartbeat_s=0.2):
        inside.set()
        time.sleep(1.5)  # the other waits: the heartbeat keeps this lock fresh
        order.append("first")
    thread.join(timeout=30)
    assert order == ["first", "second"]
    assert not s3.exists(store.lock_key("k"))

    # a builder on another host that died: its lock object's heartbeat stopped long ago
    s3.pipe_file(store.lock_key("k2"), json.dumps({"host": "gone-host", "pid": 1, "token": "dead",
                                                   "touched": time.time() - 3600}).encode())
    started = time.monotonic()
    with store.lock("k2"):
        holder = json.loads(s3.cat_file(store.lock_key("k2")))
        assert holder["host"] == socket.gethostname() and holder["token"] != "dead"
    assert time.monotonic() - started < 10

    # a live holder elsewhere (fresh heartbeat) is waited for, not broken
    s3.pipe_file(store.lock_key("k3"), json.dumps({"host": "busy-host", "pid": 1, "token": "live",
                                                   "touched": time.time()}).encode())
    done = threading.Event()

    def take():
        with store.lock("k3", stale_after_s=2.0):
            done.set()

    waiter = threading.Thread(target=take)
    waiter.start()
    assert not done.wait(1.0)  # still fresh: waiting
    assert done.wait(15)  # no heartbeat for stale_after_s: taken
    waiter.join()


# --- configuration and messages -------------------------------------------------------------------


def test_urls_are_masked_and_the_cache_is_per_url(tmp_path, monkeypatch):
    assert mask_url("s3://AKIAXXX:s3cr3t@bucket/prefix?token=abc#x") == "s3://***@bucket/prefix"
    assert mask_url("s3://bucket/prefix") == "s3://bucket/prefix"
    monkeypatch.setenv("TRT_DIFFUSION_CACHE", str(tmp_path / "caches"))
    one = local_workspace("s3://bucket/a", None, tmp_path)
    assert one.parent == tmp_path / "caches" and one != local_workspace("s3://bucket/b", None, tmp_path)
    assert local_workspace("s3://bucket/a", "mycache", tmp_path) == tmp_path / "mycache"
    assert local_workspace("file:///srv/shared/build", None, tmp_path) == Path("/srv/shared/build")
    assert local_workspace("build", None, tmp_path) == tmp_path / "build"


def test_a_store_error_never_shows_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-shown")
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{_free_port()}",
                                                   "config_kwargs": {"retries": {"max_attempts": 1},
                                                                     "connect_timeout": 1}})
    store = RemoteStore("s3://nobody-listens/ws", tmp_path)
    with pytest.raises(StoreError) as caught:
        store.record("engines/x")
    assert "s3://nobody-listens/ws" in str(caught.value)
    assert "s3cr3t" not in str(caught.value) and "AKIAEXAMPLE" not in str(caught.value)


def test_an_unknown_protocol_is_an_engines_yaml_error(tmp_path, tiny_sd15_dir, write_engines_yaml):
    config = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", workspace="nosuchproto://bucket/ws")
    with pytest.raises(ConfigError, match=r"engines.yaml:\d+: build.workspace: nosuchproto:// is not a storage"):
        load_engines_file(config)


def test_a_missing_backend_names_the_extra(tmp_path, tiny_sd15_dir, write_engines_yaml):
    """gcsfs is not installed here; s3fs is hidden from a child process the way a host without the extra lacks it."""
    config = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", workspace="gs://bucket/ws")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match=r"gcsfs.*trt-diffusion\[store\]"):
            store_for(load_engines_file(config))
    s3_config = write_engines_yaml(tmp_path / "s3", tiny_sd15_dir, "sd15", workspace="s3://bucket/ws")
    code = ("import sys; sys.modules['s3fs'] = None\n"
            "from trt_diffusion.cli import main\n"
            f"sys.exit(main(['manifest', {str(s3_config)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "s3fs" in result.stderr and "pip install 'trt-diffusion[store]'" in result.stderr
    assert "Traceback" not in result.stderr


# --- a shared directory ---------------------------------------------------------------------------


def test_a_shared_directory_workspace_is_used_in_place_by_every_host(tmp_path, built_sd15):
    shared = tmp_path / "nfs" / "build"
    shutil.copytree(built_sd15.parent / "build" / "onnx", shared / "onnx")
    hosts = []
    for name in ("host-a", "host-b"):
        data = yaml.safe_load(built_sd15.read_text())
        data["build"]["workspace"] = shared.as_uri()  # file:///…/nfs/build
        (tmp_path / name).mkdir()
        path = tmp_path / name / "engines.yaml"
        path.write_text(yaml.safe_dump(data))
        hosts.append(path)
    assert load_engines_file(hosts[0]).workspace == shared and store_for(load_engines_file(hosts[0])) is None
    first_shards, second_shards = two_host_shards(hosts[0])
    first = build_shards(hosts[0], first_shards)
    second = build_shards(hosts[1], second_shards)
    assert first.built and second.built and not first.failed and not second.failed
    final = api.build(hosts[1])
    assert not final.built and len(final.cached) == 4
    assert api.manifest(hosts[0])["counts"]["ok"] == 4
