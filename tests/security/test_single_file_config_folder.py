"""A single-file checkpoint's `config:` folder gets the model-folder allow-list (issue 32, finding 6): its
model_index.json may name only diffusers and transformers classes; before, from_single_file imported
whatever module an entry named."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import save_file

from trt_diffusion.errors import ModelError
from trt_diffusion.models.single_file import FAMILY_MARKERS, convert_single_file, reference_config_dir


def test_a_config_folder_naming_another_module_is_refused_before_anything_is_imported(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "planted_module_32.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nclass Anything: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_module_32", raising=False)
    config = tmp_path / "config"
    shutil.copytree(reference_config_dir("sd15"), config)  # the shipped config, one entry changed
    index = json.loads((config / "model_index.json").read_text())
    index["scheduler"] = ["planted_module_32", "Anything"]
    (config / "model_index.json").write_text(json.dumps(index))
    first, second = FAMILY_MARKERS["sd15"]
    checkpoint = tmp_path / "model.safetensors"
    save_file({first: torch.zeros(1), second + "x": torch.zeros(1)}, str(checkpoint))
    with pytest.raises(ModelError, match=r"model_index.json: scheduler names \['planted_module_32', 'Anything'\]; only "
                                         r"diffusers and transformers classes are loaded"):
        convert_single_file(checkpoint, tmp_path / "out", family="sd15", config=config)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
