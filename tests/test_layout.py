"""The tree's shape: every test file is collected, no folder hides behind a name pytest skips, and no
module outside trt_diffusion/targets/ (and the registry that names them) compares a target's name."""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trt_diffusion"
# pytest's default norecursedirs (its docs); linters skip `build`/`dist`/`venv` too.
NORECURSE = ("*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}")


def _project_dirs():
    for folder in (PACKAGE, ROOT / "tests", ROOT / "scripts"):
        for path in folder.rglob("*"):
            if path.is_dir() and "__pycache__" not in path.parts:
                yield path


def test_no_folder_is_named_like_one_pytest_or_linters_skip():
    hidden = [str(p.relative_to(ROOT)) for p in _project_dirs()
              if any(fnmatch.fnmatch(p.name, pattern) for pattern in NORECURSE)]
    assert hidden == []


def test_every_test_file_is_collected():
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider",
                             str(ROOT / "tests")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert files - collected == set()


def _target_names() -> set[str]:
    from trt_diffusion.targets import target_names

    return set(target_names()) | {"openvino"}


def _compared_names(tree: ast.AST, names: set[str]):
    """String constants that are a target's name used in a comparison (==, !=, in, match/case)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                for value in values:
                    if isinstance(value, ast.Constant) and value.value in names:
                        yield node.lineno, value.value
        elif isinstance(node, ast.Dict):  # a lookup table keyed by target name is a comparison in disguise
            for key in node.keys:
                if isinstance(key, ast.Constant) and key.value in names:
                    yield node.lineno, key.value
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in names:
            yield node.lineno, node.value.value


def test_no_module_outside_targets_compares_a_target_name():
    names = _target_names()
    found = []
    for path in PACKAGE.rglob("*.py"):
        if (PACKAGE / "targets") in path.parents or path == PACKAGE / "target_registry.py":
            continue
        for line, name in _compared_names(ast.parse(path.read_text()), names):
            found.append(f"{path.relative_to(ROOT)}:{line}: {name!r}")
    assert found == []


@pytest.mark.parametrize("source", ['if spec.target == "tensorrt": pass', 'x = {"onnxruntime": 1}',
                                    'ok = target in ("tensorrt", "x")'])
def test_the_target_name_check_catches_a_comparison(source):
    assert list(_compared_names(ast.parse(source), _target_names()))
