"""Everything an export's output depends on, hashed into the artifact's key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..components.base import ComponentDef
from ..components.model_config import ModelConfig
from ..workspace.files import sha256_file, tool_versions
from .grouping import ExportGroup
from .parity import TOLERANCES
from .shapes import ExportShapes

# Bump when the export code changes what it writes (wrappers, passes, external-data layout).
EXPORTER_VERSION = 1


def folder_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file in a component folder (weights, shards index, config.json)."""
    return {path.relative_to(folder).as_posix(): sha256_file(path)
            for path in sorted(folder.rglob("*")) if path.is_file() and not path.name.startswith(".")}


def describe_inputs(group: ExportGroup, definition: ComponentDef, config: ModelConfig, shapes: ExportShapes,
                    weights: Path, loras: list[tuple[str, Path, float]]) -> dict[str, Any]:
    return {
        "stage": "export", "exporter_version": EXPORTER_VERSION,
        "component": {"family": group.family, "component": group.component, "kind": definition.kind,
                      "version": definition.version},
        "io": definition.io(config, group.options).to_json(),
        "model_config": config.to_json(),
        "weights": folder_digest(weights),
        "loras": [{"name": name, "sha256": sha256_file(path), "scale": scale} for name, path, scale in loras],
        "precision": group.precision,
        "exporter": {"dynamo": True, "optimize": False, **group.options},
        "shapes": shapes.to_json(),
        "tolerance": TOLERANCES[group.precision].__dict__,
        "tools": tool_versions("export"),
    }
