"""engines.yaml files over `family_workspace` (tests/conftest.py): some families' minimal entries with fields
changed, over the same workspace, so what the change leaves alone is built once for every file that asks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml


def families_engines_yaml(workspace, path: Path, families, **model_fields: Any) -> Path:
    """engines.yaml at `path` over `workspace`'s (family_workspace): its entries of `families` only, each with
    `model_fields` merged in (a `precision` dict is merged into the entry's)."""
    from trt_diffusion.engines_file import load_engines_file

    document = yaml.safe_load(workspace.path.read_text())
    models = {name: model for name, model in document["models"].items() if name in families}
    for model in models.values():
        for field, value in model_fields.items():
            # a copy per model: one object under two entries would be dumped as a YAML alias, which the file refuses
            model[field] = {**model.get(field, {}), **value} if field == "precision" else copy.deepcopy(value)
    workspace = load_engines_file(workspace.path).workspace
    path.write_text(yaml.safe_dump({"version": 1, "build": {"workspace": str(workspace)}, "models": models},
                                   sort_keys=False))
    return path
