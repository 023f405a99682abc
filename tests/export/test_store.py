"""The artifact store: reuse only verified artifacts, never a half-written one."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from trt_diffusion.workspace.files import sha256_file
from trt_diffusion.workspace.store import MANIFEST_NAME, ArtifactStore, hash_inputs

HASH = hash_inputs({"weights": "abc", "opset": 20})


def _write(store: ArtifactStore, text: str = "graph", input_hash: str = HASH):
    with store.writer("onnx", "m.unet.fp32", input_hash) as writer:
        (writer.path / "model.onnx").write_text(text)
        (writer.path / "model.onnx.data").write_bytes(b"\0" * 10)
        writer.manifest.update(parity={"max_abs": 1e-7})
    return store.lookup("onnx", "m.unet.fp32", input_hash)


def test_committed_artifact_is_found_with_its_manifest(tmp_path):
    store = ArtifactStore(tmp_path)
    artifact = _write(store)
    assert artifact is not None and artifact.path == tmp_path / "onnx" / f"m.unet.fp32.{HASH[:16]}"
    assert artifact.manifest["parity"] == {"max_abs": 1e-7} and artifact.manifest["kind"] == "onnx"
    recorded = {o["path"]: o["sha256"] for o in artifact.outputs}
    assert recorded == {"model.onnx": sha256_file(artifact.file("model.onnx")),
                        "model.onnx.data": sha256_file(artifact.file("model.onnx.data"))}
    assert sorted(p.name for p in (tmp_path / "onnx").iterdir()) == [artifact.path.name]  # no temp or lock left


def test_hash_inputs_is_order_independent_and_sensitive():
    assert hash_inputs({"a": 1, "b": [1, 2]}) == hash_inputs({"b": [1, 2], "a": 1})
    assert hash_inputs({"a": 1}) != hash_inputs({"a": 2})


def test_other_inputs_are_a_miss(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store)
    other = hash_inputs({"weights": "abd", "opset": 20})
    assert store.lookup("onnx", "m.unet.fp32", other) is None
    assert store.lookup("quantized", "m.unet.fp32", HASH) is None


@pytest.mark.parametrize("damage", ["edit_output", "delete_output", "delete_manifest", "bad_hash_in_manifest"])
def test_a_damaged_artifact_is_not_trusted_and_is_replaced(tmp_path, damage):
    store = ArtifactStore(tmp_path)
    artifact = _write(store)
    if damage == "edit_output":
        artifact.file("model.onnx").write_text("grapH")  # same size, other bytes
    elif damage == "delete_output":
        artifact.file("model.onnx.data").unlink()
    elif damage == "delete_manifest":
        artifact.file(MANIFEST_NAME).unlink()
    else:
        manifest = json.loads(artifact.file(MANIFEST_NAME).read_text())
        manifest["input_hash"] = "0" * 64
        artifact.file(MANIFEST_NAME).write_text(json.dumps(manifest))
    assert store.lookup("onnx", "m.unet.fp32", HASH) is None
    again = _write(store, text="fresh")
    assert again is not None and again.file("model.onnx").read_text() == "fresh"


def test_failed_write_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError, match="parity failed"):
        with store.writer("onnx", "m.unet.fp32", HASH) as writer:
            (writer.path / "model.onnx").write_text("half")
            raise RuntimeError("parity failed")
    assert list((tmp_path / "onnx").iterdir()) == []
    assert store.lookup("onnx", "m.unet.fp32", HASH) is None


def test_abandoned_temp_folder_is_ignored_then_removed_but_a_live_one_is_kept(tmp_path):
    store = ArtifactStore(tmp_path)
    kind_dir = tmp_path / "onnx"
    kind_dir.mkdir()
    dead = kind_dir / f".tmp.m.unet.fp32.{HASH[:16]}.99999.dead"
    dead.mkdir()
    (dead / "model.onnx").write_text("half written")
    (dead / MANIFEST_NAME).write_text(json.dumps({"input_hash": HASH}))
    (kind_dir / (dead.name + ".lock")).write_text("")  # nobody holds it: its writer was killed
    live = kind_dir / f".tmp.m.vae.fp32.{HASH[:16]}.{os.getpid()}.live"
    live.mkdir()
    with open(kind_dir / (live.name + ".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a writer in another process, still working
        assert store.lookup("onnx", "m.unet.fp32", HASH) is None
        assert _write(store) is not None
        assert not dead.exists() and not (kind_dir / (dead.name + ".lock")).exists()
        assert live.is_dir()


def test_manifest_keys_of_the_store_cannot_be_overwritten(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(ValueError, match="input_hash"):
        with store.writer("onnx", "x", HASH) as writer:
            (writer.path / "f").write_text("1")
            writer.manifest["input_hash"] = "forged"
    assert store.lookup("onnx", "x", HASH) is None
