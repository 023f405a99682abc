"""Stripped plans in a Triton repository (#27: STRIP_PLAN as a release option), on CPU.

A plan built `strip_plan: true` holds no weights: `package` ships the ONNX it was built from (checked against the
manifest's sha256) beside it, with its external data, and serves it with a python-backend model whose runner refits
every weight from that ONNX when it loads (Triton's TensorRT backend cannot refit). Checked on the generated
repository's files; the TensorRT runtime is a stand-in that records what it deserializes."""

from __future__ import annotations

import hashlib
import importlib.machinery
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.errors import BuildError, RefitError
from trt_diffusion.onnx_facts import onnx_sha256
from trt_diffusion.targets.base import BuiltEngine
from trt_diffusion.targets.tensorrt import engine_group, host_probe, plan_load, trt_log
from trt_diffusion.targets.tensorrt import refit as trt_refit
from trt_diffusion.targets.tensorrt.build_flags import BuildFlags
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, engine_path, manifest_path
from trt_diffusion.targets.tensorrt.target import TensorRTTarget
from trt_diffusion.tensors import TensorSpec
from trt_diffusion.triton import configs
from trt_diffusion.triton.repository import PackageOptions, package
from trt_diffusion.triton.validate import read_configs

HOST = ("10.13.0.35", (9, 0), "NVIDIA H200")
STRIPPED = (("tensorrt_strip_plan", True),)


def onnx_with_external_data(folder: Path, name: str, inputs, outputs) -> Path:
    """An ONNX whose weights live in an external data file, as large exports keep them."""
    folder.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.arange(4096, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Identity", [inputs[0].name], [outputs[0].name])], name,
                              [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.shape)) for t in inputs],
                              [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.shape)) for t in outputs],
                              initializer=[weight])
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    return path


def stripped_engine(workspace: Path, component: str, bucket, inputs, outputs, profile, strip=True) -> BuiltEngine:
    spec = EngineSpec(model="tiny", family="sd15", source="/m", component=component, target="tensorrt",
                      precision="fp32", batch=1, bucket=bucket, build_options=STRIPPED if strip else ())
    source = onnx_with_external_data(workspace / "onnx" / component, component, inputs, outputs)
    plan = engine_path(workspace, spec)
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_bytes(b"stripped plan of " + component.encode())
    manifest = EngineManifest(
        spec_key=spec.key, spec_name=spec.name, tensorrt_version=HOST[0], compute_capability=HOST[1],
        device_name=HOST[2], flags=BuildFlags.for_spec(spec, False).to_dict(), profile_shapes=profile,
        onnx_sha256=onnx_sha256(source), onnx_path=str(source), inputs=tuple(inputs), outputs=tuple(outputs),
        plan_bytes=plan.stat().st_size, plan_sha256=hashlib.sha256(plan.read_bytes()).hexdigest(), build_seconds=0)
    manifest.write(manifest_path(plan))
    return BuiltEngine(spec, plan, manifest)


def t(name, *shape, dtype="float32"):
    return TensorSpec(name=name, dtype=dtype, shape=tuple(shape))


def sd15_engines(workspace: Path, strip=True) -> list[BuiltEngine]:
    bucket = Bucket.static(Size(64, 64))
    return [
        stripped_engine(workspace, "text_encoder", None, [t("input_ids", 1, 77)], [t("hidden_states", 1, 77)],
                        {"input_ids": ((1, 77),) * 3}, strip),
        stripped_engine(workspace, "unet", bucket, [t("sample", 1, 4, 8, 8)], [t("noise_pred", 1, 4, 8, 8)],
                        {"sample": ((1, 4, 8, 8),) * 3}, strip),
        stripped_engine(workspace, "vae_decoder", bucket, [t("latent", 1, 4, 8, 8)], [t("images", 1, 4, 8, 8)],
                        {"latent": ((1, 4, 8, 8),) * 3}, strip),
    ]


class FakeRuntime:
    def __init__(self, logger):
        self.engine_host_code_allowed = False

    def deserialize_cuda_engine(self, plan):
        return types.SimpleNamespace(plan=bytes(plan))


@pytest.fixture
def fake_tensorrt(monkeypatch):
    module = types.ModuleType("tensorrt")
    module.__version__, module.Builder, module.Runtime = HOST[0], object, FakeRuntime
    module.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)  # torch's import probes ask for one
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(trt_log, "trt_logger", lambda: None)
    monkeypatch.setattr(host_probe, "host_info", lambda device_index=0: HOST)
    refits = []
    monkeypatch.setattr(trt_refit, "refit_from_base", lambda engine, onnx_path, weights=None: refits.append(
        (engine.engine.plan, Path(onnx_path))))
    return refits


def test_package_ships_the_onnx_a_stripped_plan_refits_from_and_its_runner_refits_at_load(
        tmp_path, tiny_model_factory, fake_tensorrt):
    engines = sd15_engines(tmp_path / "ws")
    repo = tmp_path / "repo"
    report = package(engines, tiny_model_factory("sd15"), "sd15", "tiny", repo,
                     PackageOptions(ensemble=False, stream=False))
    models = read_configs(repo)
    unet = models["tiny__unet__64x64__b1"]
    assert unet.backend == "python" and not unet.platform  # Triton's TensorRT backend cannot refit a plan
    assert configs.mc.ModelInstanceGroup.Kind.Name(unet.instance_group[0].kind) == "KIND_GPU"
    assert unet.parameters["weights_onnx"].string_value == "weights.onnx"
    version = repo / unet.name / "1"
    assert sorted(p.name for p in version.iterdir()) == ["manifest.json", "model.onnx.data", "model.plan", "model.py",
                                                         "weights.onnx"]
    manifest = EngineManifest.read(version / "manifest.json")
    assert onnx_sha256(version / "weights.onnx") == manifest.onnx_sha256  # the very ONNX, external data and all
    assert any("refits each plan from the weights.onnx" in note for note in report.notes)

    runner = TensorRTTarget().runner_from_files(version, unet.name)
    assert fake_tensorrt == []  # nothing loaded by creating the runner
    runner._loader(runner.path)  # what the runner calls when it loads (activate, Triton's warm-up)
    assert fake_tensorrt == [(b"stripped plan of unet", version / "weights.onnx")]

    data = version / "model.onnx.data"
    data.chmod(0o644)
    data.write_bytes(data.read_bytes()[:-4] + b"\0\0\0\1")  # weights changed after packaging
    with pytest.raises(RefitError, match="not the ONNX the plan was built from"):
        runner._loader(runner.path)


def test_a_stripped_plan_whose_onnx_is_gone_or_changed_is_not_packaged(tmp_path, tiny_model_factory):
    engines = sd15_engines(tmp_path / "ws")
    Path(engines[1].manifest.onnx_path).with_name("model.onnx.data").write_bytes(b"other weights")
    with pytest.raises(RefitError, match="not the ONNX the plan was built from"):
        package(engines, tiny_model_factory("sd15"), "sd15", "tiny", tmp_path / "repo")
    gone = [*engines[:1], BuiltEngine(engines[1].spec, engines[1].path,
                                       engines[1].manifest.model_copy(update={"onnx_path": None})), engines[2]]
    with pytest.raises(BuildError, match="its manifest names none"):
        package(gone, tiny_model_factory("sd15"), "sd15", "tiny", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_a_plan_with_weights_stays_a_tensorrt_plan_model(tmp_path, tiny_model_factory):
    engines = sd15_engines(tmp_path / "ws", strip=False)
    package(engines, tiny_model_factory("sd15"), "sd15", "tiny", tmp_path / "repo",
            PackageOptions(ensemble=False, stream=False))
    unet = read_configs(tmp_path / "repo")["tiny__unet__64x64__b1"]
    assert unet.platform == "tensorrt_plan"
    assert sorted(p.name for p in (tmp_path / "repo" / unet.name / "1").iterdir()) == ["manifest.json", "model.plan"]


# ---------------------------------------------------------------------------------------------- the instance's GPU


def test_engine_models_instance_groups_name_the_gpus_and_kind(tmp_path, tiny_model_factory):
    """`package --gpu 1`: every KIND_GPU engine model's instance group lists GPU 1 (`engine_instances` on each);
    the pipeline models stay KIND_CPU with no GPUs."""
    repo = tmp_path / "repo"
    package(sd15_engines(tmp_path / "ws"), tiny_model_factory("sd15"), "sd15", "tiny", repo,
            PackageOptions(ensemble=False, stream=False, gpus=(1,), engine_instances=2))
    models = read_configs(repo)
    for name in ("tiny__unet__64x64__b1", "tiny__vae_decoder__64x64__b1", "tiny__text_encoder__any__b1"):
        group = models[name].instance_group[0]
        assert (configs.mc.ModelInstanceGroup.Kind.Name(group.kind), list(group.gpus), group.count) == (
            "KIND_GPU", [1], 2)
    entry = models["tiny"].instance_group[0]
    assert configs.mc.ModelInstanceGroup.Kind.Name(entry.kind) == "KIND_CPU" and list(entry.gpus) == []
    package(sd15_engines(tmp_path / "ws2", strip=False), tiny_model_factory("sd15"), "sd15", "tiny",
            tmp_path / "native", PackageOptions(ensemble=False, stream=False, gpus=(0, 1)))
    native = read_configs(tmp_path / "native")["tiny__unet__64x64__b1"]
    assert native.platform == "tensorrt_plan" and list(native.instance_group[0].gpus) == [0, 1]
    with pytest.raises(Exception, match="gpus must be distinct GPU indices"):
        PackageOptions(gpus=(1, 1)).check()


class _Utils:
    """The python backend's utils as far as the engine model uses them."""

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


def test_a_gpu_instance_runs_its_runner_on_the_gpu_triton_gave_it(tmp_path, tiny_model_factory, monkeypatch):
    """The python backend says `model_instance_kind: GPU`, `model_instance_device_id: 1`: the runner's group is on
    GPU 1 and every allocation and launch happens with GPU 1 current (the fake CUDA records the device of each
    cudaMalloc); the load probes GPU 1. A CPU instance passes no device."""
    import json

    fake = pytest.importorskip("tensorrt_stub_fake")
    if fake.stub_path() is None:
        pytest.skip("tensorrt-stubs are not installed")
    from trt_diffusion import targets
    from trt_diffusion.targets.tensorrt import runner as trt_runner
    from trt_diffusion.targets.tensorrt.cudart import Cuda
    from trt_diffusion.triton.backend import engine_model, pb

    repo = tmp_path / "repo"
    package(sd15_engines(tmp_path / "ws"), tiny_model_factory("sd15"), "sd15", "tiny", repo,
            PackageOptions(ensemble=False, stream=False, gpus=(1,)))
    trt, cudart = fake.FakeTensorRT(), fake.FakeCudart()
    groups = {}
    monkeypatch.setattr(engine_group, "default_group", lambda device=None: groups.setdefault(
        device, trt_runner.EngineGroup(cuda=Cuda(cudart), bound_bytes=1 << 30, device=device)))
    loads = []

    def load_engine(plan, *, device=0, weights_onnx=None, **kwargs):
        loads.append((device, Path(weights_onnx).name if weights_onnx else None))
        description = fake.EngineDescription(
            inputs={"sample": ("FLOAT", (1, 4, 8, 8), (1, 4, 8, 8), (1, 4, 8, 8))}, outputs={"noise_pred": "FLOAT"},
            output_shape=lambda shapes: {"noise_pred": (1, 4, 8, 8)}, compute=lambda f: {"noise_pred": f["sample"] + 1})
        return types.SimpleNamespace(engine=trt.engine(description, cudart), manifest=EngineManifest.read(
            manifest_path(plan)))

    monkeypatch.setattr(plan_load, "load_engine", load_engine)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: trt)  # the stub-generated enums
    monkeypatch.setattr(pb, "utils", lambda: _Utils)
    monkeypatch.setattr(pb, "input_array", lambda request, name: request[name])
    name = "tiny__unet__64x64__b1"
    config = (repo / name / "config.pbtxt").read_text()
    from google.protobuf import json_format

    model_config = json.dumps(json_format.MessageToDict(configs.parse(config, name), preserving_proto_field_name=True))
    instance = engine_model.TritonPythonModel()
    instance.initialize({"model_config": model_config, "model_repository": str(repo / name), "model_version": "1",
                         "model_instance_kind": "GPU", "model_instance_device_id": "1", "model_name": name})
    cudart.current_device = 0  # the thread Triton calls from starts on device 0
    feeds = {"sample": np.ones((1, 4, 8, 8), np.float32)}
    (response,) = instance.execute([feeds])
    assert response.error is None and np.array_equal(dict(response.tensors)["noise_pred"], feeds["sample"] + 1)
    assert loads == [(1, "weights.onnx")] and set(groups) == {1}
    assert cudart.malloc_devices == {1} and cudart.current_device == 1  # nothing allocated on GPU 0

    seen = []
    monkeypatch.setattr(targets, "get_target", lambda target: types.SimpleNamespace(
        runner_from_files=lambda folder, n, **kw: seen.append(kw) or instance.runner))
    cpu = engine_model.TritonPythonModel()
    cpu.initialize({"model_config": model_config, "model_repository": str(repo / name), "model_version": "1",
                    "model_instance_kind": "CPU", "model_instance_device_id": "0"})
    assert seen == [{}]
    assert engine_model.instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "3"}) == 3
