"""The build stage end to end on the onnxruntime target: engines per shape, reuse, failures, LoRA refit."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import yaml

from trt_diffusion import api
from trt_diffusion.cli import main
from trt_diffusion.engines_file import load_engines_file
from trt_diffusion.errors import BuildError, RefitError
from trt_diffusion.models.tiny import build_tiny_lora, build_tiny_pipeline
from trt_diffusion.runtime.loader import engine_runners
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.targets import get_target

REQUEST = GenerationRequest(prompt="a red fox in the snow", height=64, width=64, steps=3, seed=4)


def test_every_engine_built_and_a_second_build_is_a_no_op(built_sd15):
    config = load_engines_file(built_sd15)
    report = api.build(built_sd15)
    assert not report.failed and len(report.cached) == len(report.outcomes) == 4
    names = sorted(o.spec.name for o in report.outcomes)
    assert names == sorted(["sd15-tiny.text_encoder.b1.fp32", "sd15-tiny.unet.64x64.b2.fp32",
                            "sd15-tiny.vae_decoder.64x64.b1.fp32", "sd15-tiny.controlnet.canny.64x64.b2.fp32"])
    unet = next(o for o in report.outcomes if o.spec.component == "unet")
    assert unet.spec.refittable and (unet.path / "refit_map.json").is_file()
    assert config.models["sd15-tiny"].refittable


def test_tensorrt_target_is_skipped_with_its_reason(tmp_path, built_sd15, capsys):
    data = yaml.safe_load(built_sd15.read_text())
    data["models"]["sd15-tiny"]["targets"] = ["onnxruntime", "tensorrt"]
    data["build"]["workspace"] = str(built_sd15.parent / "build")
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["build", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "skipped target tensorrt" in out and "tensorrt" in out
    assert main(["build", str(path), "--target", "tensorrt"]) == 1  # asked by name: the extra's install line
    err = " ".join(capsys.readouterr().err.split())
    assert "--target tensorrt needs the tensorrt extra" in err and "pip install 'trt-diffusion[tensorrt]'" in err


def test_engines_reproduce_the_reference_image(built_sd15):
    config = load_engines_file(built_sd15)
    model_dir, family, table = engine_runners(config, "sd15-tiny", "onnxruntime")
    engines = EnginePipeline(model_dir, family, table).generate(REQUEST).images
    controlnets = {"canny": model_dir / "controlnet"}
    reference = EnginePipeline(model_dir, family, reference_runners(model_dir, family, controlnets=controlnets))
    assert np.abs(engines.astype(int) - reference.generate(REQUEST).images.astype(int)).max() <= 1


@pytest.mark.slow  # a second export and build of the UNet and VAE (about 60 s); the no-op and cache tests stay
def test_bucket_change_rebuilds_only_its_engines(tmp_path, built_sd15):
    workspace = tmp_path / "build"
    shutil.copytree(built_sd15.parent / "build", workspace)
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(workspace)
    data["models"]["sd15-tiny"]["buckets"] = ["64x64", "128x128"]
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    report = api.build(path)
    rebuilt = sorted(o.spec.name for o in report.built)
    assert rebuilt == sorted(["sd15-tiny.unet.128x128.b2.fp32", "sd15-tiny.vae_decoder.128x128.b1.fp32",
                              "sd15-tiny.controlnet.canny.128x128.b2.fp32"])
    assert len(report.cached) == 4  # the 64x64 engines and the text encoder


def _failing_vae_build(monkeypatch, exc: Exception):
    target = get_target("onnxruntime")
    real = target.build

    def failing(request):
        if request.spec.component == "vae_decoder":
            raise exc
        return real(request)

    monkeypatch.setattr(target, "build", failing)


def _fresh_workspace(tmp_path, built_sd15):
    """No engines yet; the session's verified exports copied in (what is under test is the engine build)."""
    data = yaml.safe_load(built_sd15.read_text())
    data["build"]["workspace"] = str(tmp_path / "build")
    shutil.copytree(built_sd15.parent / "build" / "onnx", tmp_path / "build" / "onnx")
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_failing_engine_is_reported_and_the_others_build(tmp_path, built_sd15, monkeypatch, capsys):
    """A tool's refusal (a TrtDiffusionError) is the user's to fix: one message, exit 1, no traceback."""
    path = _fresh_workspace(tmp_path, built_sd15)
    _failing_vae_build(monkeypatch, BuildError("simulated refusal: the builder ran out of memory"))
    assert main(["build", str(path)]) == 1
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())
    assert "simulated refusal" in out and "3 built" in out and "1 failed" in out
    assert "sd15-tiny.vae_decoder.64x64.b1.fp32" in captured.err and "Traceback" not in captured.err


def test_a_bug_in_a_target_exits_3_with_its_traceback(tmp_path, built_sd15, monkeypatch, capsys):
    """Any other exception is a bug: the other engines still build, then exit 3 with the traceback."""
    path = _fresh_workspace(tmp_path, built_sd15)
    _failing_vae_build(monkeypatch, RuntimeError("simulated builder crash"))
    report = api.build(path)
    (failed,) = report.failed
    assert failed.failure.internal and "simulated builder crash" in failed.failure.traceback
    assert len(report.built) + len(report.cached) == 3
    assert main(["build", str(path)]) == 3
    captured = capsys.readouterr()
    assert "Traceback" in captured.err and "simulated builder crash" in captured.err
    assert "internal error" in captured.err


# ------------------------------------------------------------------------------------------- LoRA


def _lora_runner(config, loras):
    model_dir, family, table = engine_runners(config, "sd15-tiny", "onnxruntime", loras=loras)
    return EnginePipeline(model_dir, family, table)


def _unet_output(pipe):
    runner = pipe.runners.find("unet", size=None, batch=2)
    rng = np.random.default_rng(0)
    feeds = {name: np.zeros([d or 1 for d in spec.shape], spec.dtype) for name, spec in runner.inputs.items()}
    feeds["sample"] = rng.standard_normal(feeds["sample"].shape).astype(np.float32)
    feeds["encoder_hidden_states"] = rng.standard_normal(feeds["encoder_hidden_states"].shape).astype(np.float32)
    feeds["timestep"] = np.full(feeds["timestep"].shape, 500.0, np.float32)
    return runner.run(feeds)["noise_pred"], feeds


@pytest.fixture(scope="module")
def second_lora(tmp_path_factory, tiny_sd15_dir):
    from diffusers import StableDiffusionPipeline

    pipe = build_tiny_pipeline("sd15")
    state = build_tiny_lora(pipe, seed=9)
    folder = tmp_path_factory.mktemp("lora-b")
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=state)
    return folder / "pytorch_lora_weights.safetensors"


def test_refit_matches_torch_with_the_lora_fused(built_sd15, tiny_sd15_dir):
    from diffusers import UNet2DConditionModel

    config = load_engines_file(built_sd15)
    lora = tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"
    out, feeds = _unet_output(_lora_runner(config, [(lora, 0.8)]))
    base, _ = _unet_output(_lora_runner(config, None))
    unet = UNet2DConditionModel.from_pretrained(tiny_sd15_dir / "unet").eval()
    unet.load_lora_adapter(str(lora), adapter_name="a", prefix="unet")
    unet.set_adapters(["a"], weights=[0.8])
    unet.fuse_lora(lora_scale=1.0)
    residuals = {k: torch.from_numpy(v) for k, v in feeds.items() if "residual" in k}
    with torch.no_grad():
        expected = unet(torch.from_numpy(feeds["sample"]), torch.from_numpy(feeds["timestep"]),
                        torch.from_numpy(feeds["encoder_hidden_states"]),
                        down_block_additional_residuals=[residuals[f"down_block_residual_{i}"]
                                                         for i in range(len(residuals) - 1)],
                        mid_block_additional_residual=residuals["mid_block_residual"]).sample.numpy()
    assert np.abs(out - base).max() > 1e-2  # the LoRA really changes the engine's output
    np.testing.assert_allclose(out, expected, atol=1e-4)


def test_a_b_a_is_bit_exact_and_scale_zero_is_base(built_sd15, tiny_sd15_dir, second_lora):
    config = load_engines_file(built_sd15)
    a = [(tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors", 1.0)]
    first, _ = _unet_output(_lora_runner(config, a))
    middle, _ = _unet_output(_lora_runner(config, [(second_lora, 1.0)]))
    again, _ = _unet_output(_lora_runner(config, a))
    assert np.abs(first - middle).max() > 1e-3
    np.testing.assert_array_equal(first, again)
    zero, _ = _unet_output(_lora_runner(config, [(a[0][0], 0.0)]))
    base, _ = _unet_output(_lora_runner(config, None))
    np.testing.assert_array_equal(zero, base)


def test_incompatible_lora_lists_unmatched_keys(built_sd15, tiny_model_factory):
    sdxl_lora = tiny_model_factory("sdxl", lora=True) / "lora/pytorch_lora_weights.safetensors"
    with pytest.raises(RefitError, match="unet"):
        _lora_runner(load_engines_file(built_sd15), [(sdxl_lora, 1.0)])
