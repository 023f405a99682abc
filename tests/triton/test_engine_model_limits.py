"""An engine model called directly takes only the shapes its engine was built for (issue 20, item 14).

Triton checks the config's rank and fixed dims; a range bucket's dynamic dims (-1 in the config) are checked
by the engine model against the profile in the packaged manifest.json: one error naming the input, the dim
and the range, and the runner never sees the request. Through the backend's own code with a stub runner
here; with a real range-bucket ONNX Runtime engine below.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.runtime.runners import CallableRunner
from trt_diffusion.tensors import TensorSpec
from trt_diffusion.triton.backend import engine_model, pb
from trt_diffusion.triton.backend.engine_model import check_profile, read_profile

# A range bucket 64x64..96x96 of the sd15 tiny VAE decoder: latents 8..12, batch 1.
PROFILE = {"latent": [[1, 4, 8, 8], [1, 4, 8, 8], [1, 4, 12, 12]]}


def latent(height: int, width: int, channels: int = 4) -> np.ndarray:
    return np.zeros((1, channels, height, width), np.float32)


@pytest.mark.parametrize("shape", [(8, 8), (12, 12), (8, 12), (10, 9)])
def test_shapes_inside_the_profile_pass(shape):
    check_profile("vae", PROFILE, {"latent": latent(*shape)})


@pytest.mark.parametrize("feed, message", [
    (latent(16, 8), "vae: input latent dim 2 is 16, the engine takes 8..12 there (latent: [1, 4, 8..12, 8..12])"),
    (latent(8, 4), "input latent dim 3 is 4, the engine takes 8..12 there"),
    (latent(8, 8, channels=3), "input latent dim 1 is 3, the engine takes 4 there"),
    (np.zeros((4, 8, 8), np.float32), "input latent has shape [4, 8, 8], the engine takes [1, 4, 8..12, 8..12]"),
])
def test_a_shape_outside_the_profile_is_one_clear_error(feed, message):
    with pytest.raises(RuntimeInputError) as caught:
        check_profile("vae", PROFILE, {"latent": feed})
    assert message in str(caught.value)


def test_every_bad_dim_is_named_once():
    with pytest.raises(RuntimeInputError) as caught:
        check_profile("vae", PROFILE, {"latent": latent(13, 200)})
    text = str(caught.value)
    assert "dim 2 is 13" in text and "dim 3 is 200" in text and text.count("vae:") == 1


def test_the_profile_comes_from_the_packaged_manifest(tmp_path):
    assert read_profile(tmp_path) == {}  # no manifest: nothing to check against (the runner still checks)
    (tmp_path / "manifest.json").write_text(json.dumps({"spec_name": "x", "profile_shapes": PROFILE}))
    assert read_profile(tmp_path) == PROFILE


class FakeUtils:
    """What the python backend's utils give a model: responses, tensors, errors."""

    class TritonError:
        INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

        def __init__(self, message, code):
            self.message, self.code = message, code

    class Logger:
        @staticmethod
        def log_error(text):
            raise AssertionError(f"internal error: {text}")

    class InferenceResponse:
        def __init__(self, tensors=(), error=None):
            self.tensors, self.error = list(tensors), error

    @staticmethod
    def Tensor(name, value):  # noqa: N802 - the backend's name
        return (name, value)


@pytest.fixture
def model(tmp_path, monkeypatch):
    """The engine model's own initialize/execute over a runner with dynamic dims (what ONNX Runtime reports for a
    range-bucket engine: it would run any size)."""
    from trt_diffusion import targets

    calls = []
    runner = CallableRunner(lambda feeds: calls.append(feeds) or {"image": np.zeros((1, 3, 8, 8), np.float32)},
                            {"latent": TensorSpec(np.dtype(np.float32), (1, 4, "height", "width"))}, name="vae")
    monkeypatch.setattr(targets, "get_target", lambda name: SimpleNamespace(runner_from_files=lambda folder, n: runner))
    monkeypatch.setattr(pb, "utils", lambda: FakeUtils)
    monkeypatch.setattr(pb, "input_array", lambda request, name: request.get(name))
    version = tmp_path / "sd15__vae_decoder__64x64-96x96__b1" / "1"
    version.mkdir(parents=True)
    (version / "manifest.json").write_text(json.dumps({"profile_shapes": PROFILE}))
    instance = engine_model.TritonPythonModel()
    instance.initialize({"model_config": json.dumps({
        "name": version.parent.name, "parameters": {"target": {"string_value": "onnxruntime"}},
        "output": [{"name": "image"}]}), "model_repository": str(version.parent), "model_version": "1"})
    return instance, calls


def test_an_engine_model_refuses_a_dim_outside_the_range_before_running(model):
    instance, calls = model
    good, bad = instance.execute([{"latent": latent(12, 10)}, {"latent": latent(64, 64)}])
    assert good.error is None and [name for name, _ in good.tensors] == ["image"]
    assert bad.error is not None and bad.error.code == "INVALID_ARG"
    assert bad.error.message == ("sd15__vae_decoder__64x64-96x96__b1: input latent dim 2 is 64, the engine takes "
                                 "8..12 there (latent: [1, 4, 8..12, 8..12]); input latent dim 3 is 64, the engine "
                                 "takes 8..12 there (latent: [1, 4, 8..12, 8..12])")
    assert len(calls) == 1  # the bad request never reached the runner


@pytest.fixture(scope="module")
def range_vae(tmp_path_factory, tiny_sd15_dir, write_engines_yaml) -> Path:
    """The sd15 tiny VAE decoder built by the onnxruntime target for a range bucket 64x64..96x96."""
    from trt_diffusion import api
    from trt_diffusion.engines_file import expand, load_engines_file
    from trt_diffusion.targets import get_target

    config = write_engines_yaml(tmp_path_factory.mktemp("range-vae"), tiny_sd15_dir, "sd15",
                                buckets=[{"min": "64x64", "opt": "64x64", "max": "96x96"}])
    report = api.build(config, target="onnxruntime", component="vae_decoder")
    assert not report.failed, [o.failure for o in report.failed]
    loaded = load_engines_file(config, check_sources=True)
    (spec,) = [s for s in expand(loaded) if s.component == "vae_decoder"]
    return Path(get_target("onnxruntime").find(loaded.workspace, spec).path)


@pytest.mark.slow  # builds one engine (about a minute on 2 cores)
def test_a_real_range_bucket_engine_refuses_what_onnxruntime_would_run(range_vae, tmp_path, monkeypatch):
    """The engine folder as packaged (model.onnx, manifest.json), its real runner: 64x64..96x96 takes latents
    8..12; a 128x128 latent (16) ran before, it is refused now."""
    from trt_diffusion.targets import get_target

    monkeypatch.setattr(pb, "utils", lambda: FakeUtils)
    monkeypatch.setattr(pb, "input_array", lambda request, name: request.get(name))
    runner = get_target("onnxruntime").runner_from_files(range_vae, "vae")
    (name,) = runner.inputs
    assert runner.inputs[name].shape[2:] != (8, 8)  # dynamic: ONNX Runtime itself would not refuse 16
    instance = engine_model.TritonPythonModel()
    instance.initialize({"model_config": json.dumps({
        "name": "vae", "parameters": {"target": {"string_value": "onnxruntime"}},
        "output": [{"name": n} for n in runner.output_names]}),
        "model_repository": str(range_vae.parent), "model_version": range_vae.name})
    ok, refused = instance.execute([{name: latent(10, 12)}, {name: latent(16, 16)}])
    assert ok.error is None
    assert refused.error is not None and f"input {name} dim 2 is 16, the engine takes 8..12 there" in refused.error.message
