"""After `package`, every engine's ONNX still loads with the standard loader (issue 18): onnx >= 1.20 refuses
external data with more than one hard link, so packaging must not hard-link it (the packaged copy and the
engine folder's own file would both be refused)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from trt_diffusion.triton import repository
from trt_diffusion.triton.repository import PackageOptions, package


@pytest.fixture(scope="module")
def packaged(sd15_engines, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("package-onnx") / "repo"
    package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name, out,
            PackageOptions(ensemble=False))
    return out


def _onnx_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.onnx"))


def test_every_packaged_engine_onnx_loads(packaged, sd15_engines):
    models = _onnx_files(packaged)
    assert len(models) == len(sd15_engines.engines)
    for path in models:
        model = onnx.load(str(path))  # reads the external data: refused when it has several hard links
        assert model.graph.node
        onnx.checker.check_model(str(path))


def test_engine_folders_stay_loadable_after_package(packaged, sd15_engines):
    for engine in sd15_engines.engines:
        for path in _onnx_files(Path(engine.path)):
            onnx.load(str(path))


def test_external_data_has_one_link_and_the_rest_is_shared(packaged, sd15_engines):
    data = [p for p in packaged.rglob("*.onnx.data")]
    assert data, "the tiny engines keep their weights as external data"
    assert all(p.stat().st_nlink == 1 for p in data)
    probe, clone = packaged / "probe", packaged / "probe-clone"
    probe.write_bytes(b"x")
    reflinks = repository._reflink(probe, clone)
    probe.unlink()
    clone.unlink(missing_ok=True)
    manifests = list(packaged.rglob("manifest.json"))  # where no reflink: hard-linked, as before
    assert manifests and all(reflinks or p.stat().st_nlink >= 2 for p in manifests)


def test_external_data_names_come_from_the_graph(sd15_engines):
    engine = sd15_engines.engines[0]
    files = {p.name: p for p in Path(engine.path).iterdir() if p.is_file()}
    assert repository._onnx_external_data(files) == {n for n in files if n.endswith(".onnx.data")}
