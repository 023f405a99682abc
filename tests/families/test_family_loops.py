"""runtime/ by job (#42): a family's loop is a `FamilyLoop` its declaration names, the pipeline dispatches to it
without a branch per family, and no loop imports the hub back (not even for annotations)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from trt_diffusion.families import Family, family_info

RUNTIME = Path(__file__).resolve().parents[2] / "trt_diffusion" / "runtime"
LOOP_ATTRIBUTES = {"flux", "wan", "qwen", "flux2"}  # the hub's old per-family loop slots


@pytest.mark.parametrize("family", [f for f in Family if family_info(f).loop], ids=str)
def test_a_declared_loop_answers_the_family_loop_protocol(family):
    module, _, name = family_info(family).loop.partition(":")
    loop = getattr(importlib.import_module(module), name)
    for method in ("runs_cfg", "encode", "denoise", "decode"):
        assert callable(getattr(loop, method, None)), f"{name} has no {method}"
    assert isinstance(getattr(loop, "runners", None), property), f"{name} has no runners property"


def test_the_pipeline_has_no_branch_per_family_loop():
    tree = ast.parse((RUNTIME / "pipeline.py").read_text())
    branches = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and sub.attr in LOOP_ATTRIBUTES:
                    branches.append(f"pipeline.py:{node.lineno} self.{sub.attr}")
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "Family" \
                        and family_info(sub.attr).loop is not None:
                    branches.append(f"pipeline.py:{node.lineno} Family.{sub.attr}")
    assert not branches, branches


@pytest.mark.parametrize("module", sorted(p.name for p in RUNTIME.glob("*_loop.py")) + ["family_loops.py"])
def test_no_loop_imports_the_hub(module):
    tree = ast.parse((RUNTIME / module).read_text())
    back = [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "pipeline"]
    assert not back, f"{module} imports runtime/pipeline.py at lines {back}"
