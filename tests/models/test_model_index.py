"""model_index.json and config.json name only diffusers / transformers model classes; nothing else is
imported (issue 20, item 7: `["this", ...]` printed the Zen of Python)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from trt_diffusion.cli import main
from trt_diffusion.errors import ModelError
from trt_diffusion.families import Component
from trt_diffusion.models.loading import load_component, read_model_index


@pytest.fixture
def model_copy(tiny_sd15_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_sd15_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def _set_entry(folder, key, value):
    index = json.loads((folder / "model_index.json").read_text())
    index[key] = value
    (folder / "model_index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("entry", [["this", "x"], ["os", "system"], ["diffusers.utils", "x"], ["../x", "y"],
                                   ["diffusers", "os.path"], [1, 2]])
def test_a_foreign_library_is_refused_and_never_imported(model_copy, monkeypatch, entry):
    monkeypatch.delitem(sys.modules, "this", raising=False)
    _set_entry(model_copy, "unet", entry)
    with pytest.raises(ModelError, match="only diffusers and transformers classes are loaded"):
        read_model_index(model_copy)
    assert "this" not in sys.modules


def test_plan_refuses_it_with_one_message(model_copy, tmp_path, capsys, write_engines_yaml, monkeypatch):
    monkeypatch.delitem(sys.modules, "this", raising=False)
    _set_entry(model_copy, "unet", ["this", "UNet2DConditionModel"])
    config = write_engines_yaml(tmp_path / "cfg", model_copy, "sd15")
    assert main(["plan", str(config)]) == 1
    captured = capsys.readouterr()
    assert "Zen of Python" not in captured.out + captured.err and "this" not in sys.modules
    assert "Traceback" not in captured.err
    assert "only diffusers and transformers classes" in " ".join(captured.err.split())


@pytest.mark.parametrize("entry", [["diffusers", "DDIMScheduler"], ["transformers", "CLIPTokenizer"],
                                   ["diffusers", "logging"]])
def test_a_component_must_be_a_model_class(model_copy, entry):
    _set_entry(model_copy, "unet", entry)
    read_model_index(model_copy)  # an allowed library...
    with pytest.raises(ModelError, match="is not a|not a diffusers or transformers model class"):
        load_component(model_copy, Component.unet)  # ...but not a model


def test_a_controlnet_config_names_a_diffusers_model(tiny_sd15_dir, tmp_path):
    from trt_diffusion.models.loading import load_controlnet

    folder = tmp_path / "cn"
    shutil.copytree(tiny_sd15_dir / "controlnet", folder)
    config = json.loads((folder / "config.json").read_text())
    config["_class_name"] = "DDIMScheduler"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="is not a diffusers.ModelMixin"):
        load_controlnet(folder)


def test_real_model_indexes_still_read(tiny_sd15_dir, model_copy):
    assert read_model_index(tiny_sd15_dir)["unet"] == ["diffusers", "UNet2DConditionModel"]
    _set_entry(model_copy, "safety_checker", ["stable_diffusion", "StableDiffusionSafetyChecker"])  # SD1.5 on the hub
    _set_entry(model_copy, "feature_extractor", [None, None])
    read_model_index(model_copy)
