"""The engine keys and ONNX keys each family's minimal engines.yaml plans (source, family, one bucket, nothing
else), recorded in plan_keys.json so a restructure of the families is checked against them: a user's build must
not be invalidated by a move of code (issue #42, acceptance 2).

    python tests/families/plan_keys.py --update   # rewrite plan_keys.json from the code as it is

A key that changes because a family's *default* changed (a deliberate rebuild) is updated with `--update` in the
commit that changes the default, and the commit says which and why.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

GOLDEN = Path(__file__).with_name("plan_keys.json")
# The source's identity is its resolved path, which differs per checkout and per pytest run: the keys are
# computed with this stand-in, so they say what the families' defaults plan, not where the folder was
SOURCE_STAND_IN = "tiny-model-folder"
# One bucket per family, the smallest each family's geometry takes (a video bucket has a frame count)
BUCKETS = {"wan": "32x32x5"}
DEFAULT_BUCKET = "64x64"


def minimal_engines_yaml(directory: Path, model_dir: Path, family: str) -> Path:
    """engines.yaml with nothing but source, family and one bucket (every other field the defaults')."""
    document = {"version": 1, "models": {family: {"source": str(model_dir), "family": family,
                                                  "buckets": [BUCKETS.get(family, DEFAULT_BUCKET)]}}}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "engines.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def all_families_engines_yaml(root: Path, model_dir_of) -> Path:
    """One engines.yaml with every family's minimal entry, each exactly what `minimal_engines_yaml` writes for it
    alone (the default suite's declaration and plan checks read those), under its family's name."""
    models = {}
    for family in family_names():
        single = minimal_engines_yaml(root / "single" / family, model_dir_of(family), family)
        models.update(yaml.safe_load(single.read_text())["models"])
    path = root / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": models}, sort_keys=False))
    return path


def planned_keys(config_path: Path) -> dict[str, dict[str, str]]:
    """target/engine name -> {engine key, ONNX key} as `plan` and the export grouping compute them (every default
    target's: the keys are plain data, computed whether or not this host builds the target)."""
    from trt_diffusion import api
    from trt_diffusion.export.grouping import export_group_key

    keys = {}
    for spec in api.plan(config_path, count_parameters=False).specs:
        stable = replace(spec, source=SOURCE_STAND_IN)
        keys[f"{spec.target}/{spec.name}"] = {"engine": stable.key, "onnx": export_group_key(stable)}
    return dict(sorted(keys.items()))


def family_names() -> list[str]:
    from trt_diffusion.families import Family

    return [family.value for family in Family]


def compute_all(workdir: Path, model_dir_of) -> dict[str, dict[str, dict[str, str]]]:
    return {family: planned_keys(minimal_engines_yaml(workdir / family, model_dir_of(family), family))
            for family in family_names()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help=f"rewrite {GOLDEN.name}")
    args = parser.parse_args(argv)
    from trt_diffusion.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        keys = compute_all(root / "configs", lambda family: write_tiny_model(root / "models" / family, family))
    if not args.update:
        golden = json.loads(GOLDEN.read_text())
        changed = sorted(f for f in set(golden) | set(keys) if golden.get(f) != keys.get(f))
        print("unchanged" if not changed else f"changed: {', '.join(changed)}")
        return 1 if changed else 0
    GOLDEN.write_text(json.dumps(keys, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
