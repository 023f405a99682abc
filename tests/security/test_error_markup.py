"""User text inside an error message is printed as text, never read as rich markup (issue 20, item 8)."""

from __future__ import annotations

from trt_diffusion.cli import main


def test_markup_in_a_path_is_printed_verbatim(tmp_path, capsys):
    path = tmp_path / "[/bold]x[red].yaml"
    assert main(["plan", str(path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    err = "".join(captured.err.split())
    assert "[/bold]x[red].yaml" in err and "nosuchfile" in err


def test_markup_in_a_model_name_is_one_clear_error(tmp_path, capsys, tiny_sd15_dir):
    path = tmp_path / "engines.yaml"
    path.write_text(f"version: 1\nmodels:\n  '[/bold]x':\n    source: {tiny_sd15_dir}\n    family: sd9\n")
    assert main(["plan", str(path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "[/bold]x" in "".join(captured.err.split())
