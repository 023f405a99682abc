"""Preflight fixtures: the session's built tiny sd15 engines (`built_sd15`: 64x64, CFG batched, ControlNet canny,
refit LoRA style, onnxruntime) under engines.yaml files that add a `preflight:` block with short settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

# Short settings: the checks measure the same things, on fewer and shorter requests.
FAST = {
    "reproducibility": {"steps": 3},
    "buckets": {"steps": 4},
    "memory": {"requests": 2, "steps": 3},
    "isolation": {"requests": 6, "concurrency": 3, "steps": [3, 5]},
    "cancellation": {"steps": 1000, "deadline_s": 0.3},
    "plugins": {"steps": 3},
    "quality": {"prompts": ["a red bicycle"], "seeds": [0, 1], "steps": 3},
    "overload": {"steps": 10, "capacity_s": 1.0, "duration_s": 5.0, "request_timeout_s": 30.0, "timeout_s": 120},
}


def _merge(base: dict, change: dict) -> dict:
    merged = dict(base)
    for key, value in change.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


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
