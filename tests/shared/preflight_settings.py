"""Short preflight settings for tests: the checks measure the same things, on fewer and shorter requests. Shared by
tests/preflight and the family tests that run the checklist over their own builds (FLUX.2, Qwen-Image)."""

from __future__ import annotations

from pathlib import Path

import yaml

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


def merge(base: dict, change: dict) -> dict:
    merged = dict(base)
    for key, value in change.items():
        merged[key] = merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def with_fast_preflight(engines_yaml: Path, folder: Path, preflight: dict | None = None) -> Path:
    """A copy of `engines_yaml` in `folder` over the same (absolute) workspace and sources, with the FAST settings
    (deep-merged with `preflight`) and the quality baseline in `folder`."""
    engines_yaml = Path(engines_yaml)
    document = yaml.safe_load(engines_yaml.read_text())
    workspace = Path(document["build"]["workspace"])
    document["build"]["workspace"] = str(workspace if workspace.is_absolute() else engines_yaml.parent / workspace)
    for model in document["models"].values():
        source = Path(model["source"])
        model["source"] = str(source if source.is_absolute() else engines_yaml.parent / source)
    document["preflight"] = merge(merge(FAST, {"quality": {"baseline": str(Path(folder) / "baseline")}}),
                                  preflight or {})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
