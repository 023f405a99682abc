"""`trt-diffusion export`: a summary on success, one clear message and exit 1 on a user error."""

from __future__ import annotations

import shutil

import pytest

from trt_diffusion.cli import main


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_export_command_prints_a_summary(sd15_export, capsys):
    assert main(["export", str(sd15_export.config), "--component", "vae_decoder"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "sd15-tiny.vae_decoder.fp32" in out and "cached" in out and "1 ONNX graphs" in out


def _missing_folder(tmp_path, tiny_model_dir, write_engines_yaml, sd15_export):
    return [str(write_engines_yaml(tmp_path, tmp_path / "no-such-model", "sd15"))], "model folder"


def _component_the_family_lacks(tmp_path, tiny_model_dir, write_engines_yaml, sd15_export):
    return [str(sd15_export.config), "--component", "transformer"], "the sd15 family has no transformer"


def _unknown_model(tmp_path, tiny_model_dir, write_engines_yaml, sd15_export):
    return [str(sd15_export.config), "--model", "sdxl-tiny"], "no model 'sdxl-tiny'"


def _corrupt_weights(tmp_path, tiny_model_dir, write_engines_yaml, sd15_export):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("sd15"), model)
    (model / "text_encoder" / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    config = write_engines_yaml(tmp_path, model, "sd15", components=["text_encoder"])
    return [str(config), "--component", "text_encoder"], "corrupt weights file"


@pytest.mark.parametrize("case", [_missing_folder, _component_the_family_lacks, _unknown_model, _corrupt_weights])
def test_user_errors_exit_1_with_one_message(case, tmp_path, tiny_model_dir, write_engines_yaml, sd15_export, capsys):
    args, expected = case(tmp_path, tiny_model_dir, write_engines_yaml, sd15_export)
    assert main(["export", *args]) == 1
    err = capsys.readouterr().err
    assert expected in _flat(err) and "Traceback" not in err
    assert _flat(err).startswith("error:")
