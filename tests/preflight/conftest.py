"""Preflight fixtures: the session's built tiny sd15 engines (`built_sd15`: 64x64, CFG batched, ControlNet canny,
refit LoRA style, onnxruntime) under engines.yaml files that add a `preflight:` block with short settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from preflight_settings import FAST
from preflight_settings import merge as _merge


@pytest.fixture(scope="session")
def preflight_yaml(built_sd15, tmp_path_factory):
    """`preflight_yaml(preflight=None, models=None, name="engines.yaml") -> Path`: engines.yaml over the built
    workspace with the FAST preflight settings (deep-merged with `preflight`), baselines in a fresh folder."""
    document = yaml.safe_load(Path(built_sd15).read_text())
    document["build"]["workspace"] = str((Path(built_sd15).parent / document["build"]["workspace"]).resolve())
    counter = iter(range(10_000))

    def write(preflight: dict | None = None, model_changes: dict | None = None, rename: str | None = None) -> Path:
        folder = tmp_path_factory.mktemp(f"preflight-{next(counter)}")
        doc = yaml.safe_load(yaml.safe_dump(document))
        (name, model), = doc["models"].items()
        model.update(model_changes or {})
        doc["models"] = {rename or name: model}
        settings = _merge(FAST, {"quality": {"baseline": str(folder / "baseline")}})
        doc["preflight"] = _merge(settings, preflight or {})
        path = folder / "engines.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return write
