"""`models tiny --overwrite` replaces only a folder that `models tiny` wrote (issue 20, item 1)."""

from __future__ import annotations

import pytest

from trt_diffusion.cli import main
from trt_diffusion.models.tiny import write_tiny_model

MARKER_FILE = "trt_diffusion_tiny.json"


def _one_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return " ".join(captured.err.split())


def test_overwrite_of_the_working_directory_is_refused(tmp_path, monkeypatch, capsys):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "precious.txt").write_text("keep me")
    (scratch / MARKER_FILE).write_text("{}")  # even a folder that looks like a tiny model
    monkeypatch.chdir(scratch)
    assert main(["models", "tiny", "--out", ".", "--overwrite"]) == 1
    assert "working directory" in _one_error(capsys)
    assert (scratch / "precious.txt").read_text() == "keep me"


def test_overwrite_of_a_parent_of_the_working_directory_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert main(["models", "tiny", "--out", "..", "--overwrite"]) == 1
    _one_error(capsys)
    assert (tmp_path / "precious.txt").is_file()


def test_overwrite_of_home_is_refused(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / MARKER_FILE).write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    assert main(["models", "tiny", "--out", str(home), "--overwrite"]) == 1
    assert "home" in _one_error(capsys)
    assert (home / MARKER_FILE).is_file()


def test_overwrite_of_a_folder_this_tool_did_not_write_is_refused(tmp_path, capsys):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"jpg")
    assert main(["models", "tiny", "--out", str(other), "--overwrite"]) == 1
    assert "not written by" in _one_error(capsys)
    assert (other / "holiday.jpg").is_file()


def test_overwrite_of_a_file_or_a_link_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert main(["models", "tiny", "--out", str(tmp_path / "notes.txt"), "--overwrite"]) == 1
    _one_error(capsys)
    assert (tmp_path / "notes.txt").read_text() == "x"
    real = tmp_path / "real"
    real.mkdir()
    (real / MARKER_FILE).write_text("{}")
    (tmp_path / "link").symlink_to(real)
    assert main(["models", "tiny", "--out", str(tmp_path / "link"), "--overwrite"]) == 1
    _one_error(capsys)
    assert (real / MARKER_FILE).is_file()


def test_a_tiny_model_folder_is_overwritten(tmp_path):
    out = write_tiny_model(tmp_path / "m", "sd15")
    (out / "stale.txt").write_text("old")
    write_tiny_model(out, "sd15", overwrite=True)
    assert (out / MARKER_FILE).is_file() and not (out / "stale.txt").exists()


@pytest.mark.parametrize("flag", [[], ["--overwrite"]])
def test_existing_non_model_folder_keeps_its_files(tmp_path, capsys, flag):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_text("1")
    assert main(["models", "tiny", "--out", str(tmp_path / "data"), *flag]) == 1
    _one_error(capsys)
    assert (tmp_path / "data" / "f").is_file()
