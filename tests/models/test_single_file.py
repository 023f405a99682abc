"""Single-file checkpoints (issue 17, acceptance 3 and 4): `source: {file: x.safetensors, config: folder}`.

The file is written from the tiny SD1.5 model with the inverse key mapping (diffusers -> original layout),
loaded back through diffusers' single-file loading, checked weight for weight, built and compared with the
images of the folder it was written from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from trt_diffusion import api
from trt_diffusion.cli import main
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.errors import ConfigError
from trt_diffusion.models.single_file import convert_single_file, to_original_layout
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners

REQUEST = GenerationRequest(prompt="a red fox in the snow", height=64, width=64, steps=3, seed=4)


@pytest.fixture(scope="module")
def tiny_pipe(tiny_model_factory):
    from diffusers import StableDiffusionPipeline

    folder = tiny_model_factory("sd15")
    return folder, StableDiffusionPipeline.from_pretrained(folder)


@pytest.fixture(scope="module")
def single_file(tiny_pipe, tmp_path_factory):
    _, pipe = tiny_pipe
    path = tmp_path_factory.mktemp("single-file") / "tiny-sd15.safetensors"
    save_file({k: v.contiguous() for k, v in to_original_layout(pipe).items()}, str(path))
    return path


def test_the_original_layout_has_the_keys_a1111_writes(single_file):
    from safetensors import safe_open

    with safe_open(str(single_file), "pt") as handle:
        keys = set(handle.keys())
    assert "model.diffusion_model.input_blocks.0.0.weight" in keys
    assert "model.diffusion_model.input_blocks.1.0.in_layers.0.weight" in keys
    assert "first_stage_model.decoder.mid.attn_1.q.weight" in keys
    assert "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight" in keys
    assert not any(".down_blocks." in k or ".resnets." in k for k in keys)


def test_round_trip_is_weight_for_weight(tiny_pipe, single_file, tmp_path):
    from diffusers import StableDiffusionPipeline

    folder, pipe = tiny_pipe
    out = convert_single_file(single_file, tmp_path / "converted", family="sd15", config=folder)
    back = StableDiffusionPipeline.from_pretrained(out)
    for component in ("unet", "vae", "text_encoder"):
        mine, theirs = getattr(pipe, component).state_dict(), getattr(back, component).state_dict()
        assert set(mine) == set(theirs), component
        for name, value in mine.items():
            assert torch.equal(value, theirs[name]), f"{component}.{name}"


def _engines_yaml(directory, write_engines_yaml, source, **fields):
    return write_engines_yaml(directory, "unused", "sd15", name="single", source=source,
                              components=["text_encoder", "unet", "vae_decoder"],
                              precision={"text_encoder": "fp32", "unet": "fp32", "vae_decoder": "fp32"}, **fields)


@pytest.mark.slow  # an export and build of three components (~25 s); the round trip above runs by default
def test_a_single_file_builds_and_matches_the_folder_it_was_written_from(tiny_pipe, single_file, tmp_path,
                                                                         write_engines_yaml):
    folder, _ = tiny_pipe
    path = _engines_yaml(tmp_path, write_engines_yaml, {"file": str(single_file), "config": str(folder)})
    report = api.build(path, target="onnxruntime")
    assert not report.failed and len(report.built) == 3
    config = load_engines_file(path)
    assert config.models["single"].source.identity.startswith("file:")
    model_dir, family, table = engine_runners(config, "single", "onnxruntime")
    engines = EnginePipeline(model_dir, family, table).generate(REQUEST).images
    reference = EnginePipeline(folder, family, reference_runners(folder, family)).generate(REQUEST).images
    assert np.abs(engines.astype(int) - reference.astype(int)).max() <= 1
    # a second load reuses the converted folder (same file, size, mtime): nothing is rewritten
    before = (model_dir / "model_index.json").stat().st_mtime_ns
    load_engines_file(path)
    assert (model_dir / "model_index.json").stat().st_mtime_ns == before


def test_a_pickled_checkpoint_is_refused(tmp_path, write_engines_yaml):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not read")
    path = _engines_yaml(tmp_path, write_engines_yaml, {"file": str(ckpt)})
    with pytest.raises(ConfigError, match=r"model\.ckpt: only \.safetensors single files are read"):
        load_engines_file(path, check_sources=False)


def test_a_truncated_checkpoint_is_one_clear_message(single_file, tmp_path, write_engines_yaml, capsys):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(single_file.read_bytes()[:6])
    path = _engines_yaml(tmp_path, write_engines_yaml, {"file": str(cut)})
    assert main(["plan", str(path)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "cut.safetensors" in err and "not a readable .safetensors file" in err and "Traceback" not in err


def test_a_file_whose_keys_fit_no_family_is_refused(tmp_path, write_engines_yaml, capsys):
    odd = tmp_path / "odd.safetensors"
    save_file({"some.other.weight": torch.zeros(2)}, str(odd))
    path = _engines_yaml(tmp_path, write_engines_yaml, {"file": str(odd)})
    assert main(["plan", str(path)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "odd.safetensors" in err and "its keys fit no family" in err and "Traceback" not in err


def test_a_config_that_is_not_a_diffusers_folder_is_refused(single_file, tmp_path, write_engines_yaml):
    path = _engines_yaml(tmp_path, write_engines_yaml, {"file": str(single_file), "config": str(tmp_path)})
    with pytest.raises(ConfigError, match="is not a diffusers folder: model_index.json is missing"):
        load_engines_file(path)
