"""The S3 end-to-end case of issue 32 (acceptance 2): an honest host publishes the tiny sd15 engines to an
object store on loopback (moto_server); a hostile build host rewrites one engine's record so that it also
writes another engine's manifest and the cache's state; the serving host's `trt-diffusion package` exits 1
naming the unit and the field, and nothing outside its repository folder is written or deleted."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

pytest.importorskip("s3fs", reason="the S3 backend is an extra: pip install 'trt-diffusion[store]'")

from trt_diffusion.cli import main  # noqa: E402
from trt_diffusion.workspace.provenance import engine_files, provenance_path  # noqa: E402
from trt_diffusion.workspace.remote_store import RemoteStore  # noqa: E402

BUCKET = "trt-hostile"


def _tree(root: Path, skip: tuple[Path, ...]) -> dict[str, str]:
    found = {}
    for path in sorted(root.rglob("*")):
        if any(path == s or s in path.parents for s in skip) or not path.is_file():
            continue
        found[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def test_a_hostile_publisher_cannot_reach_outside_its_unit_on_the_serving_host(tmp_path, built_sd15, s3, capsys):
    url = f"s3://{BUCKET}/ws"
    honest_cache = tmp_path / "honest"
    shutil.copytree(built_sd15.parent / "build", honest_cache)
    honest = RemoteStore(url, honest_cache)
    units = []
    for folder in sorted((honest_cache / "engines" / "onnxruntime").iterdir()):
        if folder.name.startswith("."):
            continue
        key = folder.name.rsplit(".", 1)[-1]
        files = engine_files(folder) + [provenance_path(honest_cache, key)]
        unit = f"engines/onnxruntime/{folder.name}"
        honest.publish(unit, files, key=key)
        units.append(unit)

    # the hostile host: the unet's record also names the VAE's manifest and the cache's state file
    unet = next(u for u in units if ".unet." in u)
    other = next(u for u in units if u != unet)
    record = json.loads(s3.cat_file(honest.index_key(unet)))
    for relative in (f"{other}/manifest.json", ".store-state.json"):
        data = b'{"planted": true}'
        sha = hashlib.sha256(data).hexdigest()
        s3.pipe_file(honest.blob_key(sha), data)
        record["files"][relative] = {"sha256": sha, "bytes": len(data)}
    s3.pipe_file(honest.index_key(unet), json.dumps(record).encode())

    # the serving host: its own project folder and cache, the shared URL
    project = tmp_path / "project"
    project.mkdir()
    (project / "Makefile").write_text("all:\n\techo mine\n")
    data = yaml.safe_load(built_sd15.read_text())
    data["build"] = {"workspace": url, "cache": str(project / "cache")}
    config = project / "engines.yaml"
    config.write_text(yaml.safe_dump(data))
    before = _tree(tmp_path, skip=(project / "cache", project / "triton_repo"))

    code = main(["package", str(config), "--out", str(project / "triton_repo")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1, err
    assert unet in err and "field 'files'" in err and "outside the unit" in err and "Traceback" not in err
    assert _tree(tmp_path, skip=(project / "cache", project / "triton_repo")) == before
    planted = [p for p in (project / "cache").rglob("*") if p.is_file() and b"planted" in p.read_bytes()]
    assert planted == []
    assert not (project / "triton_repo").exists()


def test_a_hostile_openvino_manifest_cannot_delete_a_file_of_the_serving_host(tmp_path, built_sd15, s3, capsys):
    """Issue 32 finding 1 through the store: the unet's record carries a manifest whose cache_blob names an
    absolute path of the serving host; `package` used to open it as the blob and its reflink step deleted it."""
    pytest.importorskip("openvino", reason="the openvino extra is not installed")
    from trt_diffusion import api

    url = f"s3://{BUCKET}/ov"
    builder = tmp_path / "builder"
    shutil.copytree(built_sd15.parent / "build" / "onnx", builder / "build" / "onnx")
    data = yaml.safe_load(built_sd15.read_text())
    model = next(iter(data["models"].values()))
    model["targets"] = ["openvino"]
    model.pop("controlnets", None)
    model.pop("loras", None)
    data["preflight"] = {"target": "openvino"}
    (builder / "engines.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    report = api.build(builder / "engines.yaml", target="openvino")
    assert not report.failed, [o.error for o in report.failed]

    victim_file = tmp_path / "serving-host" / "important.txt"
    victim_file.parent.mkdir()
    victim_file.write_text("mine\n")
    cache = builder / "build"
    store = RemoteStore(url, cache)
    for folder in sorted((cache / "engines" / "openvino").iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        key = folder.name.rsplit(".", 1)[-1]
        if ".unet." in folder.name:  # the hostile build host's manifest
            manifest = json.loads((folder / "manifest.json").read_text())
            manifest["cache_blob"] = str(victim_file)
            (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        files = engine_files(folder) + [p for p in [provenance_path(cache, key)] if p.is_file()]
        store.publish(f"engines/openvino/{folder.name}", files, key=key)

    serving = tmp_path / "serving-host"
    data["build"] = {"workspace": url, "cache": str(serving / "cache")}
    config = serving / "engines.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    code = main(["package", str(config), "--out", str(serving / "triton_repo"), "--target", "openvino"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1, err
    assert "sd15-tiny.unet" in err and "cache_blob" in err and "plain file name" in err and "Traceback" not in err
    assert victim_file.read_text() == "mine\n"
