"""A command that would do nothing says why and fails, instead of printing an empty table and exiting 0;
`plan` marks the engines this machine cannot build."""

from __future__ import annotations

import json

import pytest

from trt_diffusion.cli import main
from trt_diffusion.targets import get_target


def _unavailable_target() -> str:
    for name in ("tensorrt", "openvino"):
        if get_target(name).unavailable_reason():
            return name
    pytest.skip("every target can build on this machine")


def test_build_of_a_target_the_file_does_not_list_is_an_error(tmp_path, tiny_sd15_dir, write_engines_yaml, capsys):
    path = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15")  # targets: [onnxruntime]
    assert main(["build", str(path), "--target", "openvino"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--target openvino" in err and "asks for no openvino engines" in err and "onnxruntime" in err
    assert not (tmp_path / "build").exists()  # nothing was exported for a build that builds nothing


def test_a_build_whose_every_target_is_skipped_fails(tmp_path, tiny_sd15_dir, write_engines_yaml, capsys):
    target = _unavailable_target()
    path = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", targets=[target])
    assert main(["build", str(path)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing to build on this machine" in err and target in err


def test_plan_marks_and_counts_what_this_machine_cannot_build(tmp_path, tiny_sd15_dir, write_engines_yaml, capsys):
    target = _unavailable_target()
    path = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15", targets=["onnxruntime", target])
    assert main(["plan", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(row["target"], row["component"]): row for row in result["rows"]}
    assert rows[(target, "unet")]["not_here"] and rows[("onnxruntime", "unet")]["not_here"] is None
    assert result["buildable_here"] == result["total_engines"] / 2
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{target} *" in out and "not buildable here" in out and f"{result['buildable_here']} buildable" in out


def test_parity_on_a_target_the_file_does_not_list_names_the_file(tmp_path, tiny_sd15_dir, write_engines_yaml,
                                                                   capsys):
    path = write_engines_yaml(tmp_path, tiny_sd15_dir, "sd15")
    assert main(["parity", str(path), "--target", "tensorrt"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "lists no tensorrt engines" in err and "run `trt-diffusion build" not in err
