"""`build.tensorrt.engine_layout: profiles` end to end on CPU (#27 design gap 1): engines.yaml expands to one engine
per weight set with a profile per bucket × batch shape (per_shape keys unchanged), the build stage hands every
profile to the builder config (a stand-in generated from the TensorRT stubs), the manifest records each profile, the
runtime's RunnerTable routes a bucket/batch to (engine, profile) and the runner runs in that profile, and `package`
lists every profile in the Triton config. No TensorRT or GPU: the builder, the engine and CUDA are stand-ins."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from trt_diffusion.engines_file import Bucket, EngineSpec, Size, expand, load_engines_file
from trt_diffusion.onnx_facts import validate_profile
from trt_diffusion.runtime.engines import ProfileRunner, RunnerTable
from trt_diffusion.runtime.loader import table_from_engines
from trt_diffusion.targets.base import BuiltEngine
from trt_diffusion.targets.runner_base import routed_profile
from trt_diffusion.targets.tensorrt import builder as trt_builder
from trt_diffusion.targets.tensorrt import engine as trt_engine
from trt_diffusion.targets.tensorrt import host_probe
from trt_diffusion.targets.tensorrt.layout import profile_envelope
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, manifest_is_current, manifest_path
from trt_diffusion.tensors import TensorSpec

fake = pytest.importorskip("tensorrt_stub_fake")
if fake.stub_path() is None:
    pytest.skip(f"tensorrt-stubs are not installed (pip install --no-deps {fake.STUB_PACKAGE})", allow_module_level=True)

HOST = ("10.13.0.35", (9, 0), "NVIDIA H200")


def engines_yaml(tmp_path: Path, model_dir: Path, layout: str | None, **model) -> Path:
    document = {"version": 1, "build": {"workspace": "build"},
                "models": {"sd15-tiny": {"source": str(model_dir), "family": "sd15", "targets": ["tensorrt"],
                                         "buckets": ["64x64", "128x128"], "batch": [1, 2], **model}}}
    if layout is not None:
        document["build"]["tensorrt"] = {"engine_layout": layout}
    path = tmp_path / (layout or "default") / "engines.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------- expansion


def test_profiles_expand_to_one_engine_per_weight_set_and_per_shape_keys_stay(tmp_path, tiny_sd15_dir):
    lora = {"style": {"source": str(tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors"), "mode": "fused"}}
    default = expand(load_engines_file(engines_yaml(tmp_path, tiny_sd15_dir, None, loras=lora)))
    per_shape = expand(load_engines_file(engines_yaml(tmp_path, tiny_sd15_dir, "per_shape", loras=lora)))
    profiles = expand(load_engines_file(engines_yaml(tmp_path, tiny_sd15_dir, "profiles", loras=lora)))
    assert [s.key for s in per_shape] == [s.key for s in default]  # the default layout: keys as they were
    assert all(not s.profiles and "profiles" not in s.key_fields() for s in default)

    by_component = {}
    for spec in profiles:
        by_component.setdefault((spec.component.value, spec.lora_variant.name if spec.lora_variant else None),
                                []).append(spec)
    (unet,) = by_component[("unet", None)]
    assert [(m.bucket.label, m.batch) for m in unet.members] == [("64x64", 2), ("64x64", 4), ("128x128", 2),
                                                                ("128x128", 4)]  # CFG batched: 1 -> 2, 2 -> 4
    assert (unet.bucket, unet.batch) == (unet.members[0].bucket, unet.members[0].batch)  # profile 0
    assert unet.name == "sd15-tiny.unet.4profiles.fp16" and unet.key not in {s.key for s in default}
    # each member is exactly the per-shape spec of that shape: same fields, same key
    assert [m.key for m in unet.members] == [s.key for s in default if s.component == "unet" and not s.lora_variant]
    assert len(by_component[("unet", "style")]) == 1  # a fused LoRA variant is a weight set of its own
    (text,) = by_component[("text_encoder", None)]
    assert [(m.bucket, m.batch) for m in text.members] == [(None, 1), (None, 2)]
    assert len(profiles) == len(by_component) == 4  # text encoder, unet, unet+style, vae decoder
    assert sum(len(s.members) for s in profiles) == len(default)
    assert EngineSpec(**{**unet.__dict__, "profiles": [{"bucket": m.bucket.to_json(), "batch": m.batch}
                                                       for m in unet.members]}).key == unet.key  # read back


def test_a_weight_set_with_one_shape_stays_the_per_shape_spec(tmp_path, tiny_sd15_dir):
    one = dict(buckets=["64x64"], batch=[1])
    default = expand(load_engines_file(engines_yaml(tmp_path, tiny_sd15_dir, None, **one)))
    profiles = expand(load_engines_file(engines_yaml(tmp_path, tiny_sd15_dir, "profiles", **one)))
    assert [s.key for s in profiles] == [s.key for s in default]  # switching the layout rebuilds nothing here


def test_plan_lists_each_engines_profiles(tmp_path, tiny_sd15_dir):
    from trt_diffusion.plan import make_plan

    plan = make_plan(load_engines_file(engines_yaml(tmp_path, tiny_sd15_dir, "profiles")), count_parameters=False)
    unet = next(e for e in plan.to_json()["engines"] if e["component"] == "unet")
    assert [(p["bucket"]["opt"], p["batch"]) for p in unet["profiles"]] == [("64x64", 2), ("64x64", 4),
                                                                            ("128x128", 2), ("128x128", 4)]
    row = next(r for r in plan.rows if r.component == "unet")
    assert row.engines == 1 and "as 1 engine with a profile per shape" in row.formula
    assert row.formula.startswith("2 buckets (64x64, 128x128) × 2 batch shapes (2, 4)")


# ---------------------------------------------------------------------------------------------- build


def _fake_builder(built: dict):
    """tensorrt.Builder/IBuilderConfig/IOptimizationProfile from the stubs, recording what the build configures."""
    trt = fake.FakeTensorRT()
    classes, dims = trt.classes, trt.dims_class()

    def profile_behaviours():
        def set_shape(self, input, min, opt, max):  # noqa: A002 - the stub's parameter names
            self._shapes[input] = tuple(tuple(d[i] for i in range(len(d))) for d in (min, opt, max))
        return fake._functions(locals())

    def config_behaviours():
        def set_flag(self, flag):
            built.setdefault("flags", []).append(flag.name)

        def clear_flag(self, flag):
            pass

        def set_memory_pool_limit(self, pool, pool_size):
            pass

        def add_optimization_profile(self, profile):
            built.setdefault("profiles", []).append(dict(profile._shapes))
            return len(built["profiles"]) - 1

        def create_timing_cache(self, serialized_timing_cache):
            return object()

        def set_timing_cache(self, cache, ignore_mismatch):
            return True
        return fake._functions(locals())

    Profile = fake.make_class(classes["IOptimizationProfile"], profile_behaviours())
    Config = fake.make_class(classes["IBuilderConfig"], config_behaviours())

    def builder_behaviours():
        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            profile = Profile()
            object.__setattr__(profile, "_shapes", {})
            return profile
        return fake._functions(locals())

    Builder = fake.make_class(classes["Builder"], builder_behaviours())
    module = SimpleNamespace(Dims=dims, MemoryPoolType=fake.make_enum(classes["MemoryPoolType"]),
                             BuilderFlag=fake.make_enum(classes["BuilderFlag"]))
    return Builder(), module


def _dynamic_onnx(path: Path) -> Path:
    weight = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "conv.weight")
    graph = helper.make_graph([helper.make_node("Conv", ["sample", "conv.weight"], ["out"])], "g",
                              [helper.make_tensor_value_info("sample", TensorProto.FLOAT, ["b", 4, "h", "w"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 4, "h", "w"])],
                              initializer=[weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_the_build_adds_every_profile_to_the_builder_config_and_the_manifest_records_them(tmp_path, monkeypatch):
    """build_engine with extra profiles: one `add_optimization_profile` each, in order, on one builder config; the
    manifest records every profile, what each is for and their envelope, and is current only for those profiles."""
    import sys

    built: dict = {}
    builder, module = _fake_builder(built)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    network = SimpleNamespace(num_inputs=1, num_outputs=1,
                              get_input=lambda i: SimpleNamespace(name="sample", dtype=SimpleNamespace(name="FLOAT"),
                                                                  shape=(-1, 4, -1, -1)),
                              get_output=lambda i: SimpleNamespace(name="out", dtype=SimpleNamespace(name="FLOAT"),
                                                                   shape=(-1, 4, -1, -1)))
    monkeypatch.setattr(trt_builder, "check_can_build", lambda spec: None)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: module)
    monkeypatch.setattr(host_probe, "host_info", lambda device_index=0: HOST)
    monkeypatch.setattr(trt_builder, "_parse_onnx", lambda onnx_path, version, name: (builder, network, None))
    monkeypatch.setattr(trt_builder, "_build_plan", lambda b, n, config, name: memoryview(b"PLAN" * 8))
    monkeypatch.setattr(trt_builder, "_save_timing_cache", lambda config, path: None)
    monkeypatch.setattr(trt_builder, "_engine_sizes", lambda plan, vc, name, profiles, onnx_weights: (
        trt_engine.EngineSizes(1 << 20, None, tuple((i + 1) << 18 for i in range(profiles)), onnx_weights)))
    members = [EngineSpec(model="m", family="sd15", source="s", component="unet", target="tensorrt",
                          precision="fp32", batch=batch, bucket=Bucket.static(Size(side, side)))
               for side, batch in ((64, 2), (128, 2), (64, 4))]
    spec = EngineSpec.with_profiles(members)
    profiles = [{"sample": ((b, 4, s // 8, s // 8),) * 3} for s, b in ((64, 2), (128, 2), (64, 4))]
    from trt_diffusion.targets.tensorrt.target import profile_labels

    manifest = trt_engine.build_engine(_dynamic_onnx(tmp_path / "m.onnx"), spec, profiles[0], tmp_path / "e.plan",
                                       tmp_path / "cache", extra_profiles=profiles[1:],
                                       profile_labels=profile_labels(spec))
    assert built["profiles"] == [validate_profile(p) for p in profiles]  # every profile, in the members' order
    assert manifest.profiles == tuple(validate_profile(p) for p in profiles)
    assert manifest.profile_shapes == profile_envelope(profiles)
    assert manifest.profile_labels == ("bucket 64x64 × batch 2", "bucket 128x128 × batch 2", "bucket 64x64 × batch 4")
    assert manifest.profile_device_memory_bytes == (1 << 18, 2 << 18, 3 << 18)  # each profile's own (#45 item 3)
    assert EngineManifest.read(manifest_path(tmp_path / "e.plan")) == manifest
    flags = trt_builder.BuildFlags.for_spec(spec, False)
    current = dict(onnx_digest=manifest.onnx_sha256, flags=flags, trt_version=HOST[0], compute_capability=HOST[1])
    assert manifest_is_current(manifest, spec, profile_shapes=profiles[0], extra_profiles=tuple(profiles[1:]),
                               **current)
    assert not manifest_is_current(manifest, spec, profile_shapes=profiles[0], **current)  # one profile only
    moved = [profiles[1], {"sample": ((4, 4, 16, 16),) * 3}]
    assert not manifest_is_current(manifest, spec, profile_shapes=profiles[0], extra_profiles=tuple(moved), **current)


def test_the_build_stage_hands_the_target_every_members_profile(tmp_path, tiny_sd15_dir, monkeypatch):
    """engine_builds.stage.build_request gives a multi-profile spec one (min, opt, max) set per member, and the
    tensorrt target builds them into one plan with their labels."""
    from trt_diffusion.engine_builds.stage import build_request, profile_for
    from trt_diffusion.targets.tensorrt.target import TensorRTTarget

    config = load_engines_file(engines_yaml(tmp_path, tiny_sd15_dir, "profiles"))
    unet = next(s for s in expand(config) if s.component == "unet")
    request = build_request(config, unet, tmp_path / "unet.onnx")
    assert [request.profile, *request.extra_profiles] == [profile_for(config, m) for m in unet.members]
    assert [p["sample"][0][0] for p in (request.profile, *request.extra_profiles)] == [2, 4, 2, 4]
    calls = []
    monkeypatch.setattr(trt_builder, "check_can_build", lambda spec: None)
    monkeypatch.setattr(TensorRTTarget, "is_current", lambda self, request: False)
    monkeypatch.setattr(TensorRTTarget, "engine_onnx", lambda self, request: request.onnx_path)
    monkeypatch.setattr(trt_builder, "build_engine", lambda *args, **kwargs: calls.append((args, kwargs)))
    TensorRTTarget().build(request)
    (args, kwargs), = calls
    assert args[1] is unet and args[2] == request.profile and kwargs["extra_profiles"] == request.extra_profiles
    assert kwargs["profile_labels"][1] == "bucket 64x64 × batch 4"


# ---------------------------------------------------------------------------------------------- routing and running


def _multi_profile_runner(tmp_path: Path, profiles):
    from trt_diffusion.targets.tensorrt.cudart import Cuda
    from trt_diffusion.targets.tensorrt.runner import EngineGroup, TensorRTRunner

    envelope = profile_envelope(profiles)
    (low, opt, high), = envelope.values()
    plan = tmp_path / "unet.plan"
    plan.write_bytes(b"\0" * 100)
    EngineManifest(spec_key="k", spec_name="unet", tensorrt_version=HOST[0], compute_capability=(8, 9),
                   device_name="fake", flags={}, profile_shapes=envelope, profiles=tuple(profiles),
                   onnx_sha256="0" * 64, plan_bytes=100, build_seconds=0.0,
                   plan_sha256=hashlib.sha256(plan.read_bytes()).hexdigest(),
                   inputs=(TensorSpec(name="sample", dtype="float32", shape=(-1, 4, -1, -1)),),
                   outputs=(TensorSpec(name="out", dtype="float32", shape=(-1, 4, -1, -1)),)).write(manifest_path(plan))
    trt, cudart = fake.FakeTensorRT(), fake.FakeCudart()
    description = fake.EngineDescription(
        inputs={"sample": ("FLOAT", low, opt, high)}, outputs={"out": "FLOAT"},
        output_shape=lambda shapes: {"out": shapes.get("sample", high)},
        compute=lambda feeds: {"out": feeds["sample"] * 2 + 1}, profiles=profiles)

    def load(path):
        return SimpleNamespace(engine=trt.engine(description, cudart), manifest=EngineManifest.read(manifest_path(path)))

    runner = TensorRTRunner(plan, name="unet", group=EngineGroup(cuda=Cuda(cudart), bound_bytes=1 << 30),
                            loader=load, trt_module=trt)
    return runner, trt


def test_the_runner_runs_a_request_in_the_profile_it_was_routed_to(tmp_path):
    """Overlapping profiles (a range bucket and a static one inside it): by itself the runner takes the tightest;
    routed, it takes the profile the table named for the request's bucket."""
    profiles = [{"sample": ((2, 4, 8, 8), (2, 4, 12, 12), (2, 4, 16, 16))}, {"sample": ((2, 4, 8, 8),) * 3}]
    runner, trt = _multi_profile_runner(tmp_path, profiles)
    feeds = {"sample": np.ones((2, 4, 8, 8), np.float32)}
    runner.run(feeds)
    assert trt.contexts[0]._profile == 1  # the tightest
    with routed_profile(0):
        np.testing.assert_array_equal(runner.run(feeds)["out"], feeds["sample"] * 2 + 1)
    assert trt.contexts[0]._profile == 0 and len(trt.contexts) == 1  # one context, switched
    with routed_profile(1):
        runner.run({"sample": np.ones((2, 4, 16, 16), np.float32)})  # the routed profile cannot hold it
    assert trt.contexts[0]._profile == 0


def test_the_runner_table_routes_each_bucket_and_batch_to_its_engine_and_profile(tmp_path):
    members = [EngineSpec(model="m", family="sd15", source="s", component="unet", target="tensorrt",
                          precision="fp16", batch=batch, bucket=bucket)
               for bucket, batch in ((Bucket(Size(64, 64), Size(96, 96), Size(128, 128)), 2),
                                     (Bucket.static(Size(64, 64)), 2), (Bucket.static(Size(64, 64)), 4))]
    spec = EngineSpec.with_profiles(members)
    profiles = [{"sample": ((2, 4, 8, 8), (2, 4, 12, 12), (2, 4, 16, 16))}, {"sample": ((2, 4, 8, 8),) * 3},
                {"sample": ((4, 4, 8, 8),) * 3}]
    runner, trt = _multi_profile_runner(tmp_path, profiles)
    made = []
    table = table_from_engines([BuiltEngine(spec, tmp_path / "unet.plan", None)],
                               lambda engine: made.append(engine) or runner)
    assert len(made) == 1 and [(e.batch, e.profile) for e in table.entries] == [(2, 0), (2, 1), (4, 2)]
    routes = {(size, batch): table.route("unet", size=Size(size, size), batch=batch)
              for size, batch in ((64, 2), (96, 2), (64, 4), (64, 1))}
    assert {key: (route.runner is runner, route.profile) for key, route in routes.items()} == {
        (64, 2): (True, 1), (96, 2): (True, 0), (64, 4): (True, 2), (64, 1): (True, 1)}  # 1 row: padded to 2
    found = table.find("unet", size=Size(96, 96), batch=2)
    assert isinstance(found, ProfileRunner) and found.profile == 0
    found.run({"sample": np.ones((2, 4, 12, 12), np.float32)})
    assert trt.contexts[0]._profile == 0
    table.find("unet", size=Size(64, 64), batch=4).run({"sample": np.ones((4, 4, 8, 8), np.float32)})
    assert trt.contexts[0]._profile == 2
    padded = table.find("unet", size=Size(64, 64), batch=1)  # batch 1 on the batch-2 static profile
    assert padded.run({"sample": np.ones((1, 4, 8, 8), np.float32)})["out"].shape == (1, 4, 8, 8)
    assert trt.contexts[0]._profile == 1
    assert isinstance(RunnerTable().entries, list)


# ---------------------------------------------------------------------------------------------- Triton


def test_package_lists_every_profile_and_routes_each_shape_to_the_one_model(tmp_path, tiny_model_factory):
    import json

    from trt_diffusion.triton.repository import PackageOptions, package
    from trt_diffusion.triton.validate import read_configs

    def t(name, *shape, dtype="float32"):
        return TensorSpec(name=name, dtype=dtype, shape=tuple(shape))

    def engine(spec, inputs, outputs, profiles):
        plan = tmp_path / f"{spec.name}.{spec.key}.plan"
        plan.write_bytes(b"plan")
        manifest = EngineManifest(
            spec_key=spec.key, spec_name=spec.name, tensorrt_version=HOST[0], compute_capability=(9, 0),
            device_name="test", flags={}, profile_shapes=profile_envelope(profiles) if len(profiles) > 1 else profiles[0],
            profiles=tuple(profiles) if len(profiles) > 1 else None, onnx_sha256="0" * 64, inputs=tuple(inputs),
            outputs=tuple(outputs), plan_bytes=4, plan_sha256=hashlib.sha256(b"plan").hexdigest(), build_seconds=0)
        manifest.write(manifest_path(plan))
        return BuiltEngine(spec, plan, manifest)

    def spec(component, shapes):
        members = [EngineSpec(model="tiny", family="sd15", source="/m", component=component, target="tensorrt",
                              precision="fp16", batch=batch, bucket=bucket) for bucket, batch in shapes]
        return EngineSpec.with_profiles(members) if len(members) > 1 else members[0]

    small, large = Bucket.static(Size(64, 64)), Bucket.static(Size(128, 128))
    unet = spec("unet", [(small, 2), (large, 2)])
    text = engine(spec("text_encoder", [(None, 1)]), [t("input_ids", 1, 77, dtype="int64")],
                  [t("hidden_states", 1, 77, 32), t("pooled", 1, 32)], [{"input_ids": ((1, 77),) * 3}])
    unet_profiles = [{"sample": ((2, 4, s, s),) * 3, "timestep": ((2,),) * 3, "encoder_hidden_states": ((2, 77, 32),) * 3}
                     for s in (8, 16)]
    unet_engine = engine(unet, [t("sample", 2, 4, -1, -1), t("timestep", 2), t("encoder_hidden_states", 2, 77, 32)],
                         [t("noise_pred", 2, 4, -1, -1)], unet_profiles)
    vae = engine(spec("vae_decoder", [(small, 1), (large, 1)]), [t("latent", 1, 4, -1, -1)],
                 [t("images", 1, 3, -1, -1)], [{"latent": ((1, 4, s, s),) * 3} for s in (8, 16)])
    report = package([text, unet_engine, vae], tiny_model_factory("sd15"), "sd15", "tiny", tmp_path / "repo",
                     PackageOptions(ensemble=False, stream=False))
    models = read_configs(tmp_path / "repo")
    config = models["tiny__unet__2profiles"]
    assert list(config.instance_group[0].profile) == ["0", "1"]  # Triton uses profile 0 only when none are listed
    assert list(models["tiny__text_encoder__any__b1"].instance_group[0].profile) == []
    assert [list(w.inputs["sample"].dims) for w in config.model_warmup] == [[2, 4, 8, 8], [2, 4, 16, 16]]
    assert report.sizes == ["64x64", "128x128"]
    description = json.loads((tmp_path / "repo" / "tiny" / "1" / "pipeline.json").read_text())
    rows = [(e["model"], e["bucket"]["opt"], e["batch"]) for e in description["engines"] if e["component"] == "unet"]
    assert rows == [("tiny__unet__2profiles", "64x64", 2), ("tiny__unet__2profiles", "128x128", 2)]
