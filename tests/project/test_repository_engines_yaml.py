"""The repository's own engines.yaml, as `make build-engines` runs it on a fresh clone: the micro-model written
by `models micro` next to a copy of the file, then `plan`. Its `build` (every export and engine of the release
matrix) is the README's main command, run on a fresh checkout in tests/project/test_readme_commands.py (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from trt_diffusion.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """engines.yaml copied as is, with the micro-model where it points (models/micro-sd15), as the Makefile writes
    it."""
    root = tmp_path_factory.mktemp("repository-engines-yaml")
    shutil.copy2(REPO / "engines.yaml", root / "engines.yaml")
    (model,) = yaml.safe_load((REPO / "engines.yaml").read_text())["models"].values()
    assert main(["models", "micro", "--family", "sd15", "--out", str(root / model["source"])]) == 0
    return root / "engines.yaml"


def _document(checkout: Path) -> dict:
    return yaml.safe_load(checkout.read_text())


def test_plan_lists_every_engine_the_file_asks_for(checkout, capsys):
    capsys.readouterr()
    assert main(["plan", str(checkout), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    document = _document(checkout)
    (name, model), = document["models"].items()
    defaults = document.get("defaults", {})
    targets = model.get("targets", defaults.get("targets"))
    buckets = len(model["buckets"])
    assert model.get("batch", defaults.get("batch")) == [1]  # what the counts below assume
    rows = {(r["component"], r["target"]): r for r in plan["rows"] if r["model"] == name}
    for target in targets:
        assert rows[("text_encoder", target)]["engines"] == 1  # no resolution: one per batch shape
        for component in ("unet", "vae_decoder", *(f"controlnet:{cn}" for cn in model.get("controlnets", {}))):
            assert rows[(component, target)]["engines"] == buckets, (component, target)
    assert {t for _, t in rows} == set(targets)
    assert plan["total_engines"] == sum(r["engines"] for r in plan["rows"]) == len(targets) * (1 + 3 * buckets)
