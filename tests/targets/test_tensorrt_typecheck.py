"""mypy over every module of trt_diffusion/targets/tensorrt/ against TensorRT's real Python API.

TensorRT cannot be installed on CPU machines, but `tensorrt-stubs` (installed by the Makefile, --no-deps) is the
.pyi of the TensorRT 10.13 Python bindings. Installed as it is, mypy ignores it (the package has no
`py.typed` marker, so `tensorrt` is typed Any and nothing is checked), and the generated stub has syntax
errors of its own (a parameter named `in`, a parameter without default after defaulted ones). So the
test copies the stub files into a temporary folder on MYPYPATH, repairing exactly those syntax errors in
the copy, and runs mypy there: errors inside the stubs are silenced (pyproject's [tool.mypy] override),
errors in our modules are not.

A canary file that misspells a TensorRT attribute is checked in the same run and must fail: the proof,
on every run, that TensorRT is really typed (a check that cannot fail checks nothing).
"""

from __future__ import annotations

import ast
import importlib.metadata
import keyword
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "trt_diffusion" / "targets" / "tensorrt"
STUB_DISTRIBUTION = "tensorrt-stubs"
MYPY_TIMEOUT_S = 300

CANARY = '''\
import tensorrt as trt


def canary(builder: trt.Builder) -> None:
    builder.create_netwrk(0)  # misspelled on purpose: mypy must report it
'''


def tensorrt_modules() -> list[Path]:
    """Every module under targets/tensorrt/ (by glob: whoever adds one gets it checked)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _split_params(text: str) -> list[str]:
    params, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += char
    return params + [current] if current.strip() else params


def _repair_line(line: str) -> str:
    """Fix the two kinds of syntax error the generated stub has, on one `def` line."""
    names = "|".join(k for k in keyword.kwlist if k.islower())
    line = re.sub(rf"([(,]\s*)({names})(\s*:)", r"\1\2_\3", line)
    match = re.match(r"^(\s*def \w+\()(.*)(\)\s*(?:->[^:]*)?:.*)$", line)
    if match:
        head, body, tail = match.groups()
        params, seen_default = [], False
        for param in _split_params(body):
            stripped = param.strip()
            is_plain = ":" in stripped and "=" not in stripped and not stripped.startswith("*")
            if seen_default and is_plain:
                param += " = ..."
            seen_default = seen_default or "=" in stripped
            params.append(param)
        line = head + ",".join(params) + tail
    return line


def repair_stub(text: str, name: str, attempts: int = 200) -> str:
    """Parse, repair the line a SyntaxError points at, repeat; fail when a line cannot be repaired."""
    lines = text.splitlines()
    for _ in range(attempts):
        try:
            ast.parse("\n".join(lines), filename=name, feature_version=(3, 11))
            return "\n".join(lines) + "\n"
        except SyntaxError as err:
            index = (err.lineno or 1) - 1
            fixed = _repair_line(lines[index])
            if fixed == lines[index]:
                raise AssertionError(f"{name}:{err.lineno}: cannot repair stub syntax error: {err.msg}") from err
            lines[index] = fixed
    raise AssertionError(f"{name}: more than {attempts} syntax errors")


def prepared_stubs(destination: Path) -> Path:
    """The distribution's .pyi files, repaired, in a folder to put on MYPYPATH."""
    try:
        files = [f for f in importlib.metadata.files(STUB_DISTRIBUTION) or () if str(f).endswith(".pyi")]
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{STUB_DISTRIBUTION} is not installed: pip install -e '.[test]' (it is pinned in the test extra)")
    assert any(str(f) == "tensorrt/__init__.pyi" for f in files), files
    for file in files:
        target = destination / str(file)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(repair_stub(Path(file.locate()).read_text(), str(file)))
    return destination


def run_mypy(paths: list[Path], stubs: Path, cache: Path) -> tuple[int, list[str]]:
    if shutil.which("mypy", path=str(Path(sys.executable).parent)) is None:
        try:
            import mypy  # noqa: F401
        except ImportError:
            pytest.fail("mypy is not installed: pip install -e '.[test]' (it is pinned in the test extra)")
    env = {**os.environ, "MYPYPATH": str(stubs)}
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(cache),
               "--no-error-summary", "--hide-error-context", *map(str, paths)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=MYPY_TIMEOUT_S)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines


def _errors(lines: list[str]) -> list[str]:
    return [line for line in lines if ": error:" in line]


@pytest.mark.timeout(MYPY_TIMEOUT_S + 60)
def test_tensorrt_modules_type_check_against_the_tensorrt_stubs(tmp_path):
    modules = tensorrt_modules()
    assert {"__init__.py", "manifest.py", "engine.py"} <= {p.name for p in modules}
    canary = tmp_path / "canary" / "trt_canary.py"
    canary.parent.mkdir()
    canary.write_text(CANARY)
    stubs = prepared_stubs(tmp_path / "stubs")

    code, lines = run_mypy([*modules, canary], stubs, tmp_path / "mypy-cache")

    errors = _errors(lines)
    ours = [line for line in errors if "trt_canary.py" not in line]
    assert not ours, "mypy found errors in targets/tensorrt/ against the TensorRT stubs:\n" + "\n".join(ours)
    canary_errors = [line for line in errors if "trt_canary.py" in line]
    assert len(canary_errors) == 1 and '"Builder" has no attribute "create_netwrk"' in canary_errors[0], (
        "the canary's misspelled TensorRT attribute was not reported: TensorRT is typed Any, the check checks "
        "nothing:\n" + "\n".join(lines))
    assert code == 1


def test_stub_repair_fixes_only_the_generated_syntax_errors():
    text = ("class P:\n"
            "    def configure(self, in: list[int], out: list[int]) -> None: ...\n"
            "    def add(self, a: int, b: int = None, axis: int) -> int: ...\n")
    repaired = repair_stub(text, "p.pyi")
    assert "def configure(self, in_: list[int], out: list[int]) -> None: ..." in repaired
    assert "def add(self, a: int, b: int = None, axis: int = ...) -> int: ..." in repaired
    with pytest.raises(AssertionError, match="cannot repair"):
        repair_stub("def f(:\n", "bad.pyi")
