"""Repository generation over real built engines, checked by reading the configs back (no server)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from trt_diffusion.errors import ServeError
from trt_diffusion.triton import configs
from trt_diffusion.triton.report import PackageReport
from trt_diffusion.triton.repository import PackageOptions, package
from trt_diffusion.triton.validate import read_configs, validate_repository

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def repo(sd15_engines, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton-repository") / "repo"
    report = package(sd15_engines.engines, sd15_engines.model_dir, sd15_engines.family, sd15_engines.name, out,
                     PackageOptions(max_queue_size=5, queue_timeout_s=12.5, pipeline_instances=2))
    return out, report


def _dims(tensor) -> tuple[int, ...]:
    return tuple(tensor.dims)


def test_engine_configs_parse_back_equal_to_their_manifests(repo, sd15_engines):
    out, report = repo
    models = read_configs(out)
    by_source = {m.source: m.name for m in report.engine_models()}
    for engine in sd15_engines.engines:
        config = models[by_source[str(engine.path)]]
        assert config.backend == "python" and config.max_batch_size == 0
        assert [(t.name, configs.type_name(t.data_type), _dims(t)) for t in config.input] == \
            [(t.name, configs.triton_type(t.dtype, ""), tuple(t.shape)) for t in engine.manifest.inputs]
        assert [(t.name, configs.type_name(t.data_type), _dims(t)) for t in config.output] == \
            [(t.name, configs.triton_type(t.dtype, ""), tuple(t.shape)) for t in engine.manifest.outputs]
        # warmed at the bucket's shape (static engines: min == opt == max, one sample)
        assert len(config.model_warmup) == 1
        warmed = {name: tuple(data.dims) for name, data in config.model_warmup[0].inputs.items()}
        assert warmed == {name: tuple(shapes[1]) for name, shapes in engine.manifest.profile_shapes.items()}
        version = out / config.name / "1"
        assert (version / "model.py").is_file() and (version / "manifest.json").is_file()
        assert os.stat(version / "model.onnx").st_ino == os.stat(engine.path / "model.onnx").st_ino  # hard link


def test_names_follow_pipeline_component_bucket_batch(repo):
    _, report = repo
    assert sorted(m.name for m in report.engine_models()) == [
        "sd15-tiny__controlnet__canny__64x64__b2", "sd15-tiny__text_encoder__any__b1", "sd15-tiny__unet__64x64__b2",
        "sd15-tiny__vae_decoder__64x64__b1"]
    assert report.controlnets == ["canny"]
    assert report.entry == "sd15-tiny" and report.ensemble == "sd15-tiny_ensemble"


def test_queue_policy_and_instances_on_the_long_running_models(repo):
    out, report = repo
    models = read_configs(out)
    for name in (report.entry, "sd15-tiny_stream", "sd15-tiny_denoise"):
        config = models[name]
        policy = config.dynamic_batching.default_queue_policy
        # the entry gathers what one UNet call takes (issue 18): batch-1 engines (b2 with CFG) take one
        # request, so there is no batch to gather and no wait for partners
        assert config.max_batch_size == 1
        assert config.dynamic_batching.max_queue_delay_microseconds == 0
        assert policy.max_queue_size == 5 and policy.default_timeout_microseconds == 12_500_000
        assert configs.mc.ModelQueuePolicy.TimeoutAction.Name(policy.timeout_action) == "REJECT"
        assert config.instance_group[0].count == 2
    assert not models["sd15-tiny_encode"].HasField("dynamic_batching")


def test_ensemble_wiring(repo):
    out, report = repo
    ensemble = read_configs(out)[report.ensemble]
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["sd15-tiny_encode", "sd15-tiny_denoise", "sd15-tiny_decode"]
    assert dict(steps[1].input_map)["POSITIVE_EMBEDS"] == dict(steps[0].output_map)["POSITIVE_EMBEDS"]
    assert dict(steps[2].input_map)["LATENTS"] == dict(steps[1].output_map)["LATENTS"]
    assert dict(steps[2].output_map) == {"IMAGE": "IMAGE"}
    optional = {t.name: t.optional for t in ensemble.input}
    assert optional["NEGATIVE_PROMPT"] and optional["CONTROLNET"] and optional["CONTROL_IMAGE"]
    assert not optional["PROMPT"]


def test_pipeline_models_carry_the_skeleton_without_weights(repo, sd15_engines):
    out, report = repo
    skeleton = out / report.entry / "1" / "model"
    assert (skeleton / "model_index.json").is_file() and (skeleton / "tokenizer" / "tokenizer.json").is_file()
    assert (skeleton / "unet" / "config.json").is_file()
    assert not list(skeleton.rglob("*.safetensors"))
    description = json.loads((out / report.entry / "1" / "pipeline.json").read_text())
    assert sorted(e["model"] for e in description["engines"]) == sorted(m.name for m in report.engine_models())


def test_report_round_trips(repo):
    out, report = repo
    again = PackageReport.read(out)
    assert again.models == report.models and again.sizes == ["64x64"] and again.request_sizes == ["64x64"]


@pytest.mark.parametrize("edit,expected", [
    (("sd15-tiny__unet__64x64__b2", "dims: 77", "dims: 76"),
     "model sd15-tiny__unet__64x64__b2: input 'encoder_hidden_states' dims are"),
    (("sd15-tiny__unet__64x64__b2", "name: \"noise_pred\"", "name: \"noise\""),
     "model sd15-tiny__unet__64x64__b2: output 'noise_pred' is missing"),
    (("sd15-tiny__vae_decoder__64x64__b1", "data_type: TYPE_FP32", "data_type: TYPE_FP16"),
     "model sd15-tiny__vae_decoder__64x64__b1: input 'latent' data_type is TYPE_FP16"),
    (("sd15-tiny_ensemble", "value: \"latents\"", "value: \"latent\""),
     "model sd15-tiny_ensemble: step 2 \\(sd15-tiny_decode\\): input_map 'LATENTS' <- 'latents', which no"),
    (("sd15-tiny_decode", "name: \"WIDTH\"", "name: \"W\""), "model sd15-tiny_decode: input 'WIDTH' is missing"),
    (("sd15-tiny", "max_batch_size: 1", "max_batch_size: 0"), "model sd15-tiny: max_batch_size is 0"),
    (("sd15-tiny__text_encoder__any__b1", "model_warmup", "# model_warmup"), "does not parse"),
])
def test_a_corrupted_config_is_named_by_model_and_field(repo, tmp_path, edit, expected):
    out, _ = repo
    copy = tmp_path / "repo"
    shutil.copytree(out, copy)
    model, old, new = edit
    path = copy / model / "config.pbtxt"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ServeError, match=expected):
        validate_repository(copy)


def test_dropped_warmup_is_caught(repo, tmp_path):
    out, _ = repo
    copy = tmp_path / "repo"
    shutil.copytree(out, copy)
    path = copy / "sd15-tiny__unet__64x64__b2" / "config.pbtxt"
    config = configs.parse(path.read_text(), "unet")
    del config.model_warmup[:]
    path.write_text(configs.to_text(config))
    with pytest.raises(ServeError, match="model sd15-tiny__unet__64x64__b2: model_warmup is empty"):
        validate_repository(copy)


def test_onnxruntime_backend_option_writes_container_configs(sd15_engines, tmp_path):
    report = package(sd15_engines.engines, sd15_engines.model_dir, "sd15", "sd15-tiny", tmp_path / "repo",
                     PackageOptions(engine_backend="native", ensemble=False))
    models = read_configs(tmp_path / "repo")
    for engine in report.engine_models():
        config = models[engine.name]
        assert config.backend == "onnxruntime" and config.default_model_filename == "model.onnx"
        assert not (tmp_path / "repo" / engine.name / "1" / "model.py").exists()
        assert (tmp_path / "repo" / engine.name / "1" / "model.onnx.data").is_file()
    assert report.ensemble is None and "sd15-tiny_ensemble" not in models
    assert any("NVIDIA's Triton containers" in note for note in report.notes)


def test_package_replaces_its_own_output_and_refuses_a_foreign_folder(sd15_engines, tmp_path):
    out = tmp_path / "repo"
    for _ in range(2):  # the second run replaces the first
        package(sd15_engines.engines, sd15_engines.model_dir, "sd15", "sd15-tiny", out, PackageOptions(ensemble=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no staging or old copies left
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ServeError, match="was not written by `trt-diffusion package`"):
        package(sd15_engines.engines, sd15_engines.model_dir, "sd15", "sd15-tiny", foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_package_stage_reads_engines_yaml(sd15_engines, tmp_path):
    from trt_diffusion.triton.stage import package_stage

    report = package_stage(sd15_engines.config_path, tmp_path / "repo", "onnxruntime")
    assert report.pipeline == "sd15-tiny" and len(report.engine_models()) == 4


def test_missing_components_are_refused(sd15_engines, tmp_path):
    without_vae = [e for e in sd15_engines.engines if e.spec.component != "vae_decoder"]
    with pytest.raises(ServeError, match=r"needs engines for \['vae_decoder'\]"):
        package(without_vae, sd15_engines.model_dir, "sd15", "sd15-tiny", tmp_path / "repo")


def test_package_command(sd15_engines, tmp_path):
    import typer
    from typer.testing import CliRunner

    from trt_diffusion.cli.serve_commands import package_command

    app = typer.Typer()
    app.command("package")(package_command)
    app.command("unused")(lambda: None)  # two commands: typer keeps the subcommand name
    out = tmp_path / "repo"
    result = CliRunner().invoke(app, ["package", str(sd15_engines.config_path), "--out", str(out), "--no-ensemble",
                                      "--max-queue-size", "3"])
    assert result.exit_code == 0, result.output
    assert "public entry" in result.output and "sd15-tiny" in result.output
    entry = read_configs(out)["sd15-tiny"]
    assert entry.dynamic_batching.default_queue_policy.max_queue_size == 3
    assert not (out / "sd15-tiny_ensemble").exists()


@pytest.mark.parametrize("unet_batches,family,expected", [
    ([2], "sd15", 1),  # batch [1] with CFG: one request a call, nothing to gather
    ([2, 4, 8], "sd15", 4),  # batch [1, 2, 4]: the batch-8 engine takes four requests' CFG rows
    ([2, 4, 8], "sd3", 4),
    ([None], "sd15", 4),  # dynamic batch: up to MAX_DYNAMIC_ROWS rows
])
def test_the_entry_gathers_what_one_denoiser_call_takes(unet_batches, family, expected):
    """More would run as several calls inside one instance while the other instance idles (measured, issue 18)."""
    from trt_diffusion.triton.description import EngineEntry, PipelineDescription
    from trt_diffusion.triton.repository import _requests_per_denoiser_call

    denoiser = "transformer" if family == "sd3" else "unet"
    engines = [EngineEntry(f"m{b}", denoiser, None, b, None, (), ()) for b in unet_batches]
    engines.append(EngineEntry("vae", "vae_decoder", None, 16, None, (), ()))  # not the denoiser: not counted
    assert _requests_per_denoiser_call(PipelineDescription("p", family, tuple(engines))) == expected
