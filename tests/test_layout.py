"""The tree's shape: every test file is collected, no folder hides behind a name pytest skips, no module outside
trt_diffusion/targets/ (and the registry that names them) compares a target's name, and no module but
trt_diffusion/precision.py spells a precision as a string literal (see test_no_precision_literal_outside_precision_py)."""

from __future__ import annotations

import ast
import fnmatch
import re
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


def _compared_in(node: ast.AST, names: set[str]):
    """(line, name) where `node` compares a string constant of `names` (==, !=, in, match/case) or keys a dict
    display by one (a lookup table keyed by name is a comparison in disguise)."""
    if isinstance(node, ast.Compare):
        for operand in [node.left, *node.comparators]:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            for value in values:
                if isinstance(value, ast.Constant) and value.value in names:
                    yield node.lineno, value.value
    elif isinstance(node, ast.Dict):
        for key in node.keys:
            if isinstance(key, ast.Constant) and key.value in names:
                yield node.lineno, key.value
    elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in names:
        yield node.lineno, node.value.value


def _compared_names(tree: ast.AST, names: set[str]):
    """String constants that are a target's name used in a comparison (==, !=, in, match/case, dict keys)."""
    for node in ast.walk(tree):
        yield from _compared_in(node, names)


def test_no_module_outside_targets_compares_a_target_name():
    names = _target_names()
    found = []
    for path in PACKAGE.rglob("*.py"):
        # extras.py is keyed by pyproject's extras, two of which are spelled like the targets they provide
        if (PACKAGE / "targets") in path.parents or path in (PACKAGE / "target_registry.py", PACKAGE / "extras.py"):
            continue
        for line, name in _compared_names(ast.parse(path.read_text()), names):
            found.append(f"{path.relative_to(ROOT)}:{line}: {name!r}")
    assert found == []


@pytest.mark.parametrize("source", ['if spec.target == "tensorrt": pass', 'x = {"onnxruntime": 1}',
                                    'ok = target in ("tensorrt", "x")'])
def test_the_target_name_check_catches_a_comparison(source):
    assert list(_compared_names(ast.parse(source), _target_names()))


# numpy's dtype names other than "int8", which is spelled like the int8 precision: a display holding one of
# these is a dtype table (numpy, TensorRT, OpenVINO or Triton type names), not a precision table.
DTYPE_NAMES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "uint8", "bool"}
NOT_A_PRECISION = "# not a precision"


def _precision_names() -> set[str]:
    from trt_diffusion.precision import Precision

    return {p.value for p in Precision}


def _precision_literals(source: str, names: set[str]):
    """(line, value) of every string constant spelled exactly like a precision that the rule counts."""
    tree = ast.parse(source)
    lines = source.splitlines()
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skipped.add(id(first.value))  # a docstring
        elif isinstance(node, ast.JoinedStr):
            skipped.update(id(value) for value in node.values)  # the text of an f-string: a message
        elif isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
            members = [*node.keys, *node.values] if isinstance(node, ast.Dict) else node.elts
            constants = [m for m in members if isinstance(m, ast.Constant) and isinstance(m.value, str)]
            if any(c.value in DTYPE_NAMES for c in constants):
                skipped.update(id(c) for c in constants)  # a dtype table
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                and id(node) not in skipped and NOT_A_PRECISION not in lines[node.lineno - 1]):
            yield node.lineno, node.value


def test_no_precision_literal_outside_precision_py():
    """A precision is `trt_diffusion.precision.Precision` (a str enum: members compare, hash and print as their
    names, so keys and messages are unchanged); the one module that spells them is precision.py.

    The rule, over every module of the package but precision.py: a string constant whose whole value is a
    precision name ("fp32", "fp16", "bf16", "fp8", "int8") is refused wherever code uses it as a value — a
    comparison, a dict key or value, a default, an argument, a return. Not counted: docstrings and comments; the
    text of f-strings (a message may say "an fp16 engine"); a constant in a dict, list, tuple or set display that
    also holds another of numpy's dtype names (a dtype table, where "int8" is numpy's dtype and "bf16"
    OpenVINO's element type); and a constant on a line marked `# not a precision`, for another vocabulary spelled
    the same (OpenVINO's bf16 precision hint, a CPU's bf16 flag). Tests may spell precisions: they are input."""
    names = _precision_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "precision.py":
            continue
        for line, value in _precision_literals(path.read_text(), names):
            found.append(f"{path.relative_to(ROOT)}:{line}: {value!r}")
    assert found == [], "name a Precision member (trt_diffusion/precision.py) instead"


@pytest.mark.parametrize("source,counted", [
    ('if spec.precision == "fp16": pass', ["fp16"]),
    ('TOLERANCE = {"fp32": 1e-3, "int8": 0.5}', ["fp32", "int8"]),
    ('def f(precision="bf16"): return "fp8"', ["bf16", "fp8"]),
    ('ok = precision in ("int8", "fp8")', ["int8", "fp8"]),
    ('def f():\n    """fp16"""\n    raise ValueError(f"not fp16: {x}")', []),
    ('ITEMSIZE = {"float32": 4, "int8": 1}', []),
    ('hint = "bf16"  # not a precision: OpenVINO\'s INFERENCE_PRECISION_HINT', []),
])
def test_the_precision_literal_check(source, counted):
    assert [value for _, value in _precision_literals(source, _precision_names())] == counted


def _family_names() -> set[str]:
    from trt_diffusion.families import Family

    return {f.value for f in Family}


FAMILY_TUPLE = re.compile(r"[A-Z0-9_]+_FAMILIES")


def _named_families(tree: ast.AST, names: set[str]):
    """(line, name) wherever code names a family instead of asking its declaration: a `Family.<member>`
    attribute, a family's name compared (==, !=, in, match/case) or keying a dict display, and a tuple, list or
    set display of families (a family tuple: `X_FAMILIES = ("sd15", "flux")`), a table looked up by a family's
    name (`MARKERS["sd15"]`), and a family tuple by its name
    (`FLUX2_FAMILIES`, however it was made)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and FAMILY_TUPLE.fullmatch(node.id):
            yield node.lineno, node.id
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if FAMILY_TUPLE.fullmatch(alias.name):
                    yield node.lineno, alias.name
        elif (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
                and node.value.id == "Family"):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.Compare, ast.Dict, ast.MatchValue)):
            yield from _compared_in(node, names)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in names:
            yield node.lineno, node.slice.value  # a table looked up by a family's name
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
                isinstance(e, ast.Constant) and e.value in names for e in node.elts):
            yield node.lineno, ", ".join(e.value for e in node.elts)


def test_no_module_outside_families_names_a_family():
    """A family is its declaration (trt_diffusion/families/<name>.py): every other module asks it
    (`family_info(family).<field>`), so a new family touches no module outside families/ but its own code."""
    names = _family_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "families") in path.parents:
            continue
        for line, name in _named_families(ast.parse(path.read_text()), names):
            found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert found == [], "ask the family's declaration (trt_diffusion/families/) instead"


@pytest.mark.parametrize("source", ["if self.family is Family.sdxl: pass", 'ok = family == "flux"',
                                    "ok = family in (Family.flux2, Family.flux2_klein)",
                                    'MICRO_FAMILIES = ("sd15", "flux")', 'LATENT_RGB = {"sd15": 1}',
                                    'match family:\n    case "wan": pass', "ok = family in FLUX2_FAMILIES",
                                    "from ..families import LM_ENCODER_FAMILIES", 'keys = MARKERS["sd15"]'])
def test_the_family_name_check_catches_a_comparison(source):
    assert list(_named_families(ast.parse(source), _family_names()))


@pytest.mark.parametrize("source", ["info = family_info(family)", 'name = "flux_loop"', "x = Family(family)",
                                    'text = f"the {family.value} family"'])
def test_the_family_name_check_passes_asking_the_declaration(source):
    assert not list(_named_families(ast.parse(source), _family_names()))
