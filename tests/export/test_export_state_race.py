"""The no-op export's record (export/export_state.py) vouches only for the inputs the export read: their stats are
taken before it runs, so a source changed while it runs (a weight file replaced, engines.yaml edited) is not
recorded as what the artifact was made from, and the next export runs the full check instead of answering 'cached'
with an artifact of the old bytes. Fakes stand in for the export itself: no torch, no model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from trt_diffusion import api
from trt_diffusion.export.results import ExportResult
from trt_diffusion.workspace.store import MANIFEST_NAME, Artifact


def _config(tmp_path: Path) -> SimpleNamespace:
    weights = tmp_path / "model" / "unet.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"old weights")
    (tmp_path / "engines.yaml").write_text("models: {}\n")
    model = SimpleNamespace(source=SimpleNamespace(path=weights.parent), controlnets={}, loras={},
                            quantization=SimpleNamespace(calibration=None))
    return SimpleNamespace(path=tmp_path / "engines.yaml", root=tmp_path, workspace=tmp_path / "build",
                           models={"sd15": model})


def test_a_source_changed_during_the_export_is_not_vouched_for_by_its_record(tmp_path, monkeypatch):
    import trt_diffusion.export as export
    from trt_diffusion.workspace import store_sync

    config = _config(tmp_path)
    group = SimpleNamespace(name="sd15/unet", key="k1", model="sd15", specs=[])
    artifact_dir = tmp_path / "build" / "artifacts" / "k1"
    artifact_dir.mkdir(parents=True)
    (artifact_dir / MANIFEST_NAME).write_text(json.dumps({"onnx": "model.onnx"}))
    exports: list[str] = []

    def export_group(group, config, store, index, total, progress):
        exports.append(group.key)
        read = (tmp_path / "model" / "unet.safetensors").read_bytes()  # what the export was made from
        if len(exports) == 1:  # ... and, while it runs, the weights are replaced
            (tmp_path / "model" / "unet.safetensors").write_bytes(b"new weights!")
        return ExportResult(group, Artifact(artifact_dir, {"onnx": "model.onnx", "from": read.decode()}),
                            cached=False, seconds=0.0)

    monkeypatch.setattr(export, "group_specs", lambda specs: [group])
    monkeypatch.setattr(export, "export_group", export_group)
    monkeypatch.setattr(store_sync, "pull_sources", lambda config: 0)
    monkeypatch.setattr(store_sync, "publish_sources", lambda config: 0)
    monkeypatch.setattr("trt_diffusion.workspace.store.ArtifactStore", lambda workspace: None)

    api.export_specs(config, [])
    second = api.export_specs(config, [])
    assert exports == ["k1", "k1"], "the record vouched for weights the first export never read"
    assert not second.results[0].cached
    third = api.export_specs(config, [])  # nothing changed since the second: now the record answers
    assert exports == ["k1", "k1"] and third.results[0].cached
