"""#45 items 3, 5 and 8, on CPU: the GPU memory a TensorRT engine takes once served, and weight streaming when serving.

- 3: Triton's TensorRT backend makes a context per listed profile, each holding the largest activation size of ALL
  profiles by default (STATIC): `package` sets ON_PROFILE_CHANGE for multi-profile plans, and `plan` and the
  served-memory estimate count activations per context and instance.
- 5: a stripped plan's file holds no weights: admission counts what it holds once refitted.
- 8: engines.yaml's `serving: tensorrt_weight_budget_gb` reaches the runners trt-diffusion loads (in process and in a
  python-backend Triton model); where Triton's TensorRT backend loads the plan, `package` says it cannot apply it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.errors import ConfigError
from trt_diffusion.targets.base import BuiltEngine
from trt_diffusion.targets.tensorrt import served_memory
from trt_diffusion.targets.tensorrt.build_flags import BuildFlags
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, engine_path, manifest_path
from trt_diffusion.targets.tensorrt.target import TensorRTTarget
from trt_diffusion.tensors import TensorSpec

HOST = ("10.13.0.35", (9, 0), "NVIDIA H200")
MIB = 1 << 20
PROFILES = ({"sample": ((1, 4, 8, 8),) * 3}, {"sample": ((1, 4, 16, 16),) * 3}, {"sample": ((1, 4, 32, 32),) * 3})


def _built(workspace: Path, *, profiles=PROFILES, per_profile=(100 * MIB, 300 * MIB, 900 * MIB), options=(),
           serving=None, plan_bytes=1000, weights_bytes=None) -> BuiltEngine:
    spec = EngineSpec(model="tiny", family="sd15", source="/m", component="unet", target="tensorrt",
                      precision="fp16", batch=1, bucket=Bucket.static(Size(64, 64)), build_options=tuple(options))
    plan = engine_path(workspace, spec)
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_bytes(b"\0" * plan_bytes)
    manifest = EngineManifest(
        spec_key=spec.key, spec_name=spec.name, tensorrt_version=HOST[0], compute_capability=HOST[1],
        device_name=HOST[2], flags=BuildFlags.for_spec(spec, False).to_dict(), profile_shapes=profiles[0],
        profiles=tuple(profiles) if len(profiles) > 1 else None, onnx_sha256="0" * 64,
        inputs=(TensorSpec(name="sample", dtype="float16", shape=(1, 4, -1, -1)),),
        outputs=(TensorSpec(name="out", dtype="float16", shape=(1, 4, -1, -1)),),
        plan_bytes=plan_bytes, plan_sha256=hashlib.sha256(plan.read_bytes()).hexdigest(), build_seconds=0,
        device_memory_bytes=max(per_profile), weights_bytes=weights_bytes,
        profile_device_memory_bytes=tuple(per_profile) if len(profiles) > 1 else None)
    manifest.write(manifest_path(plan))
    return BuiltEngine(spec, plan, manifest, serving=serving)


# ---------------------------------------------------------------------------------------------- item 3


def test_a_multi_profile_plan_is_packaged_with_each_context_holding_its_own_profiles_activations(tmp_path):
    model = TensorRTTarget().triton_model(_built(tmp_path), engine_backend="python")
    assert model.backend == "tensorrt_plan" and model.profiles == ("0", "1", "2")
    assert model.parameters == {"execution_context_allocation_strategy": "ON_PROFILE_CHANGE"}
    single = TensorRTTarget().triton_model(_built(tmp_path / "one", profiles=PROFILES[:1], per_profile=(MIB,)),
                                           engine_backend="python")
    assert single.parameters == {}  # one context, one profile: Triton's default is exact


def test_activation_memory_per_instance_follows_who_runs_the_plan():
    manifest = _built_manifest = {"device_memory_bytes": 900, "profile_device_memory_bytes": [100, 300, 900],
                                  "profiles": [{}, {}, {}]}
    assert served_memory.activation_bytes_per_instance(manifest, "tensorrt_plan") == 3 * 900  # STATIC: N x largest
    assert served_memory.activation_bytes_per_instance(manifest, "tensorrt_plan", "ON_PROFILE_CHANGE") == 1300
    assert served_memory.activation_bytes_per_instance(manifest, "python") == 900  # one context, shared memory
    old = {**_built_manifest, "profile_device_memory_bytes": None}  # a manifest from before the per-profile sizes
    assert served_memory.activation_bytes_per_instance(old, "tensorrt_plan", "ON_PROFILE_CHANGE") == 2700


def test_the_served_memory_estimate_counts_tensorrt_activations_per_context_and_instance(tmp_path):
    """#45 item 3: `triton/memory_budget.py` left activations out: a 3-profile plan under Triton holds 1300 MiB of
    activations per instance (ON_PROFILE_CHANGE), 2700 MiB with the default strategy."""
    from trt_diffusion.triton import memory_budget
    from trt_diffusion.triton.configs import engine_config
    from trt_diffusion.triton.configs import to_text as render

    engine = _built(tmp_path / "ws")
    served = TensorRTTarget().triton_model(engine, engine_backend="python")
    repo = tmp_path / "repo"
    for name, parameters in (("unet", served.parameters), ("unet_static", {})):
        version = repo / name / "1"
        version.mkdir(parents=True)
        for file, source in served.files.items():
            (version / file).write_bytes(Path(source).read_bytes())
        config = engine_config(name, inputs=[], outputs=[], backend="tensorrt_plan", model_file="model.plan",
                               instances=1, kind="KIND_GPU", warmup=[], random_warmup=False,
                               parameters={**parameters, "target": "tensorrt"}, profiles=served.profiles)
        (repo / name / "config.pbtxt").write_text(render(config))
    options = SimpleNamespace(engine_instances=2, pipeline_instances=1, lora_cache_sets=4)
    report = SimpleNamespace(entry="tiny", models=[SimpleNamespace(name="unet", role="engine", backend="tensorrt_plan")])
    (share,) = memory_budget.shares(repo, [report], options)
    assert share.activations_gb == pytest.approx(2 * 1300 * MIB / memory_budget.GB, abs=1e-4)
    assert share.total_gb == pytest.approx(share.engines_gb + share.activations_gb, abs=1e-4)
    assert "activations" in share.describe()
    report.models[0].name = "unet_static"
    (static,) = memory_budget.shares(repo, [report], options)
    assert static.activations_gb == pytest.approx(2 * 3 * 900 * MIB / memory_budget.GB, abs=1e-4)


def test_plan_reports_activations_per_profile_context_once_built(tmp_path, tiny_sd15_dir):
    from trt_diffusion.engines_file import expand, load_engines_file
    from trt_diffusion.plan import make_plan

    document = {"version": 1, "build": {"workspace": "build", "tensorrt": {"engine_layout": "profiles"}},
                "models": {"sd15-tiny": {"source": str(tiny_sd15_dir), "family": "sd15", "targets": ["tensorrt"],
                                         "buckets": ["64x64", "128x128"], "batch": [1], "cfg": ["split"]}}}
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(document))
    config = load_engines_file(path)
    row = next(r for r in make_plan(config, count_parameters=False).rows if r.component == "unet")
    assert row.activations == {"triton_contexts": 2, "triton_activation_bytes": None, "runner_contexts": 1,
                               "runner_activation_bytes": None}  # not built: contexts only
    (unet,) = [s for s in expand(config) if s.component == "unet"]
    plan = engine_path(Path(config.workspace), unet)
    plan.parent.mkdir(parents=True)
    plan.write_bytes(b"plan")
    EngineManifest(spec_key=unet.key, spec_name=unet.name, tensorrt_version=HOST[0], compute_capability=HOST[1],
                   device_name=HOST[2], flags={}, profile_shapes=PROFILES[0], profiles=PROFILES[:2],
                   onnx_sha256="0" * 64, inputs=(), outputs=(), plan_bytes=4, build_seconds=0,
                   device_memory_bytes=300, profile_device_memory_bytes=(100, 300)).write(manifest_path(plan))
    row = next(r for r in make_plan(config, count_parameters=False).rows if r.component == "unet")
    assert row.activations == {"triton_contexts": 2, "triton_activation_bytes": 400, "runner_contexts": 1,
                               "runner_activation_bytes": 300}
    assert make_plan(config, count_parameters=False).to_json()["rows"][1]["activations"] is not None


# ---------------------------------------------------------------------------------------------- item 5


def test_admission_counts_a_stripped_plans_weights_not_its_file(tmp_path):
    """#45 item 5: a stripped plan's file is small; once refitted from its ONNX it holds every weight. Two 900 MiB
    stripped engines do not fit a 1 GiB bound together: the first is unloaded for the second."""
    fake = pytest.importorskip("tensorrt_stub_fake")
    if fake.stub_path() is None:
        pytest.skip("tensorrt-stubs are not installed")
    from trt_diffusion.targets.tensorrt.cudart import Cuda
    from trt_diffusion.targets.tensorrt.runner import EngineGroup, TensorRTRunner

    trt, cudart = fake.FakeTensorRT(), fake.FakeCudart()
    group = EngineGroup(cuda=Cuda(cudart), bound_bytes=1024 * MIB)
    shape = (1, 4, 8, 8)

    def runner(name):
        engine = _built(tmp_path / name, profiles=({"sample": (shape,) * 3},), per_profile=(MIB,),
                        options=(("tensorrt_strip_plan", True),), weights_bytes=900 * MIB)
        description = fake.EngineDescription(inputs={"sample": ("HALF", shape, shape, shape)}, outputs={"out": "HALF"},
                                             output_shape=lambda shapes: {"out": shape}, compute=lambda f: {"out": f["sample"]})
        return TensorRTRunner(engine.path, name=name, group=group, trt_module=trt, loader=lambda path: SimpleNamespace(
            engine=trt.engine(description, cudart), manifest=EngineManifest.read(manifest_path(path))))

    import numpy as np

    a, b = runner("a"), runner("b")
    a.run({"sample": np.zeros(shape, np.float16)})
    b.run({"sample": np.zeros(shape, np.float16)})
    assert not a.active and b.active
    assert a.manifest.device_weights_bytes == 900 * MIB and a.manifest.plan_bytes == 1000


def test_a_stripped_builds_weights_are_the_onnxs_weight_bytes(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = [numpy_helper.from_array(np.zeros((64, 32), np.float16), "w"),
               numpy_helper.from_array(np.zeros(1000, np.float32), "b")]
    constant = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.zeros(10, np.float32)))
    graph = helper.make_graph([constant], "g", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [10])],
                              initializer=weights)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    assert served_memory.onnx_weight_bytes(path) == 64 * 32 * 2 + 1000 * 4 + 10 * 4


# ---------------------------------------------------------------------------------------------- item 8


def test_serving_weight_budget_is_validated_and_reaches_the_runners(tmp_path, tiny_sd15_dir):
    """#45 item 8: no caller passed `weight_budget_bytes`. engines.yaml's per-model `serving:` block (it changes
    no engine key) reaches the in-process runner, and the python-backend model's runner through its config.pbtxt;
    Triton's TensorRT backend cannot apply it, and `package` says so."""
    from trt_diffusion.engines_file import expand, load_engines_file
    from trt_diffusion.triton.configs import engine_config
    from trt_diffusion.triton.configs import to_text as render

    def document(serving, streaming=True, targets=("tensorrt",)):
        models = {"sd15-tiny": {"source": str(tiny_sd15_dir), "family": "sd15", "targets": list(targets),
                                **({"serving": serving} if serving is not None else {})}}
        path = tmp_path / f"e{len(list(tmp_path.glob('e*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "build": {"tensorrt": {"weight_streaming": streaming}},
                                        "models": models}))
        return path

    config = load_engines_file(document({"tensorrt_weight_budget_gb": 1.5}))
    assert config.models["sd15-tiny"].serving.tensorrt_weight_budget_gb == 1.5
    keys = [s.key for s in expand(config)]
    assert keys == [s.key for s in expand(load_engines_file(document(None)))]  # serving changes no engine key
    with pytest.raises(ConfigError, match=r"serving.tensorrt_weight_budget_gb: a TensorRT weight budget needs "
                                          r"engines built with weight streaming"):
        load_engines_file(document({"tensorrt_weight_budget_gb": 1.5}, streaming=False))
    with pytest.raises(ConfigError, match=r"tensorrt_weight_budget_gb: .*greater than or equal to 0"):
        load_engines_file(document({"tensorrt_weight_budget_gb": -1}))

    serving = config.models["sd15-tiny"].serving
    engine = _built(tmp_path / "ws", profiles=PROFILES[:1], per_profile=(MIB,),
                    options=(("tensorrt_weight_streaming", True),), serving=serving)
    assert TensorRTTarget().runner(engine).weight_budget_bytes == int(1.5 * (1 << 30))  # in process
    native = TensorRTTarget().triton_model(engine, engine_backend="python")
    assert native.backend == "tensorrt_plan" and any("not applied by Triton's TensorRT backend" in n
                                                     for n in native.notes)
    stripped = _built(tmp_path / "ws2", profiles=PROFILES[:1], per_profile=(MIB,), serving=serving,
                      options=(("tensorrt_weight_streaming", True), ("tensorrt_strip_plan", True)))
    import dataclasses

    import onnx
    from onnx import TensorProto, helper

    from trt_diffusion.onnx_facts import onnx_sha256

    onnx_path = tmp_path / "weights.onnx"
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1])])), str(onnx_path))
    stripped = dataclasses.replace(stripped, manifest=stripped.manifest.model_copy(update={
        "onnx_path": str(onnx_path), "onnx_sha256": onnx_sha256(onnx_path)}))
    python_model = TensorRTTarget()._stripped_triton_model(stripped, {}, TensorRTTarget._budget_parameters(stripped))
    assert python_model.parameters["tensorrt_weight_budget_bytes"] == str(int(1.5 * (1 << 30)))
    version = tmp_path / "repo" / "unet" / "1"
    version.mkdir(parents=True)
    for name in ("model.plan", "manifest.json"):
        (version / name).write_bytes((stripped.path if name == "model.plan" else manifest_path(stripped.path))
                                     .read_bytes())
    config_text = render(engine_config("unet", inputs=[], outputs=[], backend="python", model_file=None, instances=1,
                                       kind="KIND_GPU", warmup=[], random_warmup=False,
                                       parameters=dict(python_model.parameters)))
    (version.parent / "config.pbtxt").write_text(config_text)
    assert TensorRTTarget().runner_from_files(version, "unet").weight_budget_bytes == int(1.5 * (1 << 30))
