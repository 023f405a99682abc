"""engines.yaml is plain data: no aliases, no merge keys, bounded depth and size; every YAML problem is one
ConfigError with file:line and exit 1 (issue 20, item 6)."""

from __future__ import annotations

import tracemalloc

import pytest

from trt_diffusion.cli import main
from trt_diffusion.engines_file.yaml_lines import load_located_yaml
from trt_diffusion.errors import ConfigError


def _alias_bomb(levels: int) -> str:
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\nversion: 1\n"


CASES = [
    ("alias-bomb", _alias_bomb(6), 2, "aliases"),
    ("recursive-alias", "version: 1\nmodels: &m\n  x: [*m]\n", 3, "aliases"),
    ("merge-key-alias", "base: &b {family: sd15}\nversion: 1\nmodels:\n  m:\n    <<: *b\n", 5, "aliases"),
    ("merge-key-inline", "version: 1\nmodels:\n  m:\n    <<: {family: sd15}\n", 4, "merge keys"),
    ("deep-nesting", "version: 1\nx: " + "[" * 5000 + "]" * 5000 + "\n", 2, "nested deeper"),
    ("bad-date", "version: 1\nwhen: 2001-13-45\n", 2, "month must be in 1..12"),
    ("python-tag", "version: 1\nx: !!python/name:os.system y\n", 2, "could not determine a constructor"),
]


@pytest.mark.parametrize("case_id,body,line,fragment", CASES, ids=[c[0] for c in CASES])
def test_yaml_problem_is_one_clear_error(tmp_path, capsys, case_id, body, line, fragment):
    path = tmp_path / "engines.yaml"
    path.write_text(body)
    assert main(["plan", str(path)]) == 1  # a hang would be the test's timeout, not a slow pass
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    message = " ".join(captured.err.split())
    assert f"{path}:{line}:" in message and fragment in message, message


def test_the_443_byte_bomb_is_refused_at_once(tmp_path):
    path = tmp_path / "engines.yaml"
    path.write_text(_alias_bomb(9))
    assert len(path.read_bytes()) < 600
    # Refused before anything is expanded: expanding 9 levels of 9 aliases builds 9**9 (387 million) nodes,
    # gigabytes; the refusal allocates next to nothing (a count of bytes, not a stopwatch).
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="aliases"):
            load_located_yaml(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak


def test_too_many_values_are_refused(tmp_path):
    path = tmp_path / "engines.yaml"
    path.write_text("version: 1\nx: [" + ",".join(["1"] * 100_001) + "]\n")
    with pytest.raises(ConfigError, match="more than 100000 values"):
        load_located_yaml(path)


def test_not_utf8_is_one_clear_error(tmp_path, capsys):
    path = tmp_path / "engines.yaml"
    path.write_bytes(b"\xff\xfe\x00version: 1\n")
    assert main(["plan", str(path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "not UTF-8" in captured.err


def test_anchors_without_aliases_and_plain_files_still_load(tmp_path):
    path = tmp_path / "engines.yaml"
    path.write_text("version: 1\nmodels: &m\n  m: {family: sd15, source: x}\n")
    assert load_located_yaml(path).data["models"]["m"]["family"] == "sd15"
