"""What `tritonserver` needs to serve the TensorRT plans of a repository (#27 item 5).

A plan built `tensorrt_version_compatible: true` carries its lean runtime; Triton's TensorRT backend loads
such a plan only when started with `--backend-config=tensorrt,version-compatible=true` (it then allows the
plan's host code). The server command line adds it exactly when a packaged plan's manifest says the plan was
built version-compatible. Pure: reads the manifests `package` put beside each `model.plan`.
"""

from __future__ import annotations

import json
from pathlib import Path

VERSION_COMPATIBLE_ARG = "--backend-config=tensorrt,version-compatible=true"
PLAN_FILE, MANIFEST_FILE = "model.plan", "manifest.json"


def version_compatible_models(repo: str | Path) -> list[str]:
    """Names of the repository's models whose packaged TensorRT plan was built version-compatible."""
    found = []
    for plan in sorted(Path(repo).glob(f"*/*/{PLAN_FILE}")):
        try:
            raw = json.loads((plan.parent / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            continue  # no manifest: nothing asks for it (packaging refuses such plans anyway)
        if isinstance(raw, dict) and raw.get("target") == "tensorrt" and (raw.get("flags") or {}).get(
                "version_compatible") is True:
            found.append(plan.parent.parent.name)
    return found


def tritonserver_args(repo: str | Path) -> list[str]:
    """Extra `tritonserver` arguments for the TensorRT plans of `repo`."""
    return [VERSION_COMPATIBLE_ARG] if version_compatible_models(repo) else []
