"""An engine folder in a shared workspace is input (issue 32, findings 1, 3, 5): a manifest's file names
stay inside their folder, packaging never replaces or deletes a file it did not create, a symbolic link in
an engine folder is refused, and every engine is checked against the sha256 its manifest records."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from target_conformance import SHAPE, export_tiny, make_spec

from trt_diffusion.errors import BuildError, ServeError
from trt_diffusion.targets import BuildRequest, get_target
from trt_diffusion.triton import repository
from trt_diffusion.triton.repository import PackageOptions


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("engine-folders-onnx") / "tiny.onnx")


def _build(target_name, workspace, onnx_path):
    spec = dataclasses.replace(make_spec(target_name), precision="fp32")
    target = get_target(target_name)
    folder, _ = target.build(BuildRequest(spec=spec, onnx_path=onnx_path, profile={"sample": (SHAPE, SHAPE, SHAPE)},
                                          workspace=workspace, timing_cache_dir=workspace / "tc"))
    return target, spec, folder


def _edit_manifest(folder, **changes):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def _write_engine_model(engine, root):
    plan = repository._engine_plan("p", engine, PackageOptions(link_files=True))
    repository._write_model(root, plan, root, "sd15", PackageOptions(link_files=True))


# --- finding 1: cache_blob escapes; _reflink deleted what it did not create


def test_place_never_deletes_or_replaces_an_existing_file(tmp_path):
    source, victim = tmp_path / "engine.bin", tmp_path / "Makefile"
    source.write_bytes(b"planted recipe")
    victim.write_text("all:\n\techo mine\n")
    with pytest.raises(ServeError, match="already exists"):
        repository._place(source, victim, link=True)
    assert victim.read_text() == "all:\n\techo mine\n"
    assert not repository._reflink(source, victim)  # its exclusive create fails: the file stays
    assert victim.read_text() == "all:\n\techo mine\n"


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_openvino_cache_blob_cannot_leave_its_folder(tmp_path, tiny_onnx, where):
    pytest.importorskip("openvino")
    workspace, out = tmp_path / "ws", tmp_path / "project" / "triton_repo"
    target, spec, folder = _build("openvino", workspace, tiny_onnx)
    victim = tmp_path / "project" / "Makefile"
    victim.parent.mkdir(parents=True)
    victim.write_text("mine\n")
    if where == "relative":
        (workspace / "Makefile").write_text("planted\n")  # beside the cache folder's ../../..
        blob = "../../../Makefile"
    else:
        blob = str(victim)
    _edit_manifest(folder, cache_blob=blob)
    engine = target.find(workspace, spec)
    out.mkdir(parents=True)
    with pytest.raises(ServeError, match=r"cache_blob.*Makefile.*plain file name"):
        _write_engine_model(engine, out)
    assert victim.read_text() == "mine\n"
    with pytest.raises(BuildError, match="cache_blob"):
        target.runner_from_files(folder, spec.name)


# --- finding 5: links in engine folders


@pytest.mark.parametrize("target_name", ["onnxruntime", "openvino"])
def test_a_symbolic_link_in_an_engine_folder_is_refused(tmp_path, tiny_onnx, target_name):
    if target_name == "openvino":
        pytest.importorskip("openvino")
    workspace, out = tmp_path / "ws", tmp_path / "repo"
    target, spec, folder = _build(target_name, workspace, tiny_onnx)
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key=...\n")
    os.symlink(secret, folder / "notes.txt")
    with pytest.raises(BuildError, match=r"notes.txt is a symbolic link"):
        target.find(workspace, spec)
    os.unlink(folder / "notes.txt")
    engine = target.find(workspace, spec)
    os.symlink(secret, folder / "notes.txt")
    out.mkdir()
    with pytest.raises((ServeError, BuildError), match=r"notes.txt is a symbolic link"):
        _write_engine_model(engine, out)
    assert not any(p.name == "notes.txt" for p in out.rglob("*"))


# --- finding 3: engines verified by sha256 (find: cached verdict; package and load: full)


@pytest.mark.parametrize("target_name", ["onnxruntime", "openvino"])
def test_a_changed_engine_file_is_refused_by_find_package_and_load(tmp_path, tiny_onnx, target_name):
    if target_name == "openvino":
        pytest.importorskip("openvino")
    workspace = tmp_path / "ws"
    target, spec, folder = _build(target_name, workspace, tiny_onnx)
    engine = target.find(workspace, spec)
    payload = max((p for p in folder.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stat = payload.stat()
    payload.write_bytes(bytes(data))
    os.utime(payload, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only a full check sees it
    with pytest.raises((BuildError, ServeError), match="does not match"):
        target.triton_model(engine, engine_backend="python")
    with pytest.raises(BuildError, match="does not match"):
        target.runner(engine)
    os.utime(payload)  # a rewrite the cached verdict notices (mtime changed)
    with pytest.raises(BuildError, match="does not match"):
        target.find(workspace, spec)


def test_the_manifest_records_every_file_of_the_engine(tmp_path, tiny_onnx):
    workspace = tmp_path / "ws"
    target, spec, folder = _build("onnxruntime", workspace, tiny_onnx)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["file_sha256"]) == {p.name for p in folder.iterdir()} - {"manifest.json"}
    (folder / "extra.txt").write_text("planted")  # not recorded: not served
    files = target.triton_model(target.find(workspace, spec), engine_backend="python").files
    assert "extra.txt" not in files and "model.onnx" in files


def test_a_provenance_record_cannot_name_files_outside_the_workspace(tmp_path):
    from types import SimpleNamespace

    from trt_diffusion.workspace.provenance import provenance_path, release_manifest

    workspace, secret = tmp_path / "ws", tmp_path / "secret.env"
    secret.write_text("token")
    spec = make_spec("onnxruntime")
    record = provenance_path(workspace, spec.key)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"engine": "x", "bytes": 1, "build_seconds": 0, "built_at": "", "built_by": {},
                                  "tools": {}, "files": {"../secret.env": {"sha256": "0" * 64, "bytes": 5}}}))
    config = SimpleNamespace(workspace=workspace, path=tmp_path / "engines.yaml")
    entry = release_manifest(config, [spec])["engines"][0]
    assert entry["status"] == "modified"
    assert "must be a path inside its folder" in entry["problems"][0]
