"""`models micro` (issue 43) writes a shipped micro-model as a diffusers folder upcast to fp32, and refuses clearly
where none is shipped. The shipped folder is stood in for by the tiny sd15 model saved as fp16 with a training
record (the trained weights are not in the repository yet: docs/micro-models.md)."""

from __future__ import annotations

import json

import pytest

from trt_diffusion.cli import main
from trt_diffusion.models import micro


@pytest.fixture
def shipped(tmp_path, tiny_model_factory, monkeypatch):
    import torch
    from diffusers import DiffusionPipeline

    data = tmp_path / "data"
    monkeypatch.setattr(micro, "DATA", data)
    pipe = DiffusionPipeline.from_pretrained(tiny_model_factory("sd15"))
    pipe.to(torch.float16).save_pretrained(data / "sd15", safe_serialization=True)
    (data / "sd15" / micro.TRAINING_RECORD).write_text(json.dumps({"vocabulary": micro.VOCABULARY, "seed": 0}))
    return data / "sd15"


def test_models_micro_writes_an_fp32_folder_that_declares_the_world(shipped, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "micro-sd15"
    assert main(["models", "micro", "--family", "sd15", "--out", str(out)]) == 0
    assert micro.draws_synthetic_world(out) and (out / "model_index.json").is_file()
    with safe_open(str(out / "unet" / "diffusion_pytorch_model.safetensors"), "pt") as handle:
        assert str(handle.get_tensor(next(iter(handle.keys()))).dtype) == "torch.float32"
    capsys.readouterr()
    assert main(["models", "micro", "--family", "sd15", "--out", str(out)]) == 1  # never overwrites unasked
    assert main(["models", "micro", "--family", "sd15", "--out", str(out), "--if-missing"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "already exists (use --overwrite to replace it)" in err and "Traceback" not in err


def test_no_shipped_model_and_unknown_families_are_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(micro, "DATA", tmp_path / "empty")
    assert main(["models", "micro", "--family", "sd15", "--out", str(tmp_path / "a")]) == 1
    assert main(["models", "micro", "--family", "wan", "--out", str(tmp_path / "b")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "holds no micro-model: train it with scripts/train_micro.py --family sd15" in err
    assert "no micro-model of family 'wan'; trained ones: sd15, flux" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not micro.draws_synthetic_world(tmp_path)  # a user's folder: no record
