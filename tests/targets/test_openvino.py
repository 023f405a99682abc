"""The openvino target against real OpenVINO: engines that run at their shape with the runner's checks,
a manifest that says what runs, the compiled-model cache, honest refusals, refit, Triton configs, and the
whole tiny pipeline built and passing parity at fp32 (with a refit LoRA), int8 and bf16."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from target_conformance import SHAPE, Tiny, export_tiny, make_spec

from trt_diffusion.errors import BuildError, MissingDependencyError, RuntimeInputError, ServeError
from trt_diffusion.targets import BuildRequest, availability, get_target

pytest.importorskip("openvino", reason="the openvino extra is not installed (pip install 'trt-diffusion[openvino]')")

from trt_diffusion.targets.openvino import engine as ov_engine  # noqa: E402
from trt_diffusion.targets.openvino import host  # noqa: E402


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("ov-onnx") / "tiny.onnx")


def request(workspace, onnx_path, precision="fp32"):
    spec = dataclasses.replace(make_spec("openvino"), precision=precision)
    return BuildRequest(spec=spec, onnx_path=onnx_path, profile={"sample": (SHAPE, SHAPE, SHAPE)},
                        workspace=workspace, timing_cache_dir=workspace / "tc")


def test_manifest_says_what_runs_and_on_which_cpu(tmp_path, tiny_onnx):
    target = get_target("openvino")
    folder, cached = target.build(request(tmp_path, tiny_onnx))
    manifest = json.loads((folder / "manifest.json").read_text())
    facts = host.cpu_facts()
    assert manifest["openvino_version"] == facts.openvino_version and manifest["cpu_isa_flags"] == list(facts.isa_flags)
    assert manifest["inference_precision_hint"] == "f32" and manifest["compute"] == "f32"
    assert manifest["runtime_precisions"] == {"f32": 2}  # the conv and the linear layer, really in f32
    assert manifest["static_shapes"] and manifest["inputs"][0]["shape"] == list(SHAPE)
    blob = ov_engine.cache_dir(tmp_path / "engines", facts) / manifest["cache_blob"]
    assert blob.is_file()


def test_runner_checks_feeds_and_reuses_the_compiled_model(tmp_path, tiny_onnx):
    target = get_target("openvino")
    target.build(request(tmp_path, tiny_onnx))
    engine = target.find(tmp_path, make_spec("openvino"))
    cache = ov_engine.cache_dir(tmp_path / "engines", host.cpu_facts())
    before = sorted(p.name for p in cache.iterdir())
    runner = target.runner(engine)
    assert sorted(p.name for p in cache.iterdir()) == before  # loaded from the blob the build left
    with pytest.raises(RuntimeInputError, match=r"sample: shape \[2, 4, 16, 16\], expected float32\[2,4,8,8\]"):
        runner.run({"sample": np.zeros((2, 4, 16, 16), np.float32)})
    with pytest.raises(RuntimeInputError, match=r"sample: dtype float64"):
        runner.run({"sample": np.zeros(SHAPE)})
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    np.testing.assert_allclose(runner.run({"sample": x})["noise_pred"],
                               Tiny(0).eval()(torch.from_numpy(x)).detach().numpy(), atol=1e-5)


def test_another_cpu_or_openvino_version_is_not_current(tmp_path, tiny_onnx, monkeypatch):
    target = get_target("openvino")
    req = request(tmp_path, tiny_onnx)
    target.build(req)
    assert target.is_current(req)
    other = host.CpuFacts(**{**host.cpu_facts().__dict__, "isa_flags": ("avx2", "amx_bf16")})
    monkeypatch.setattr(host, "cpu_facts", lambda: other)
    assert not target.is_current(req)


def test_bf16_and_fp16_are_refused_where_the_cpu_cannot_compute_them(tmp_path, tiny_onnx):
    target = get_target("openvino")
    caps = host.cpu_facts().capabilities
    for precision, needed in (("bf16", "BF16"), ("fp16", "FP16")):
        if needed in caps:
            folder, _ = target.build(request(tmp_path, tiny_onnx, precision))
            hint = json.loads((folder / "manifest.json").read_text())["inference_precision_hint"]
            assert hint == {"bf16": "bf16", "fp16": "f16"}[precision]
        else:
            with pytest.raises(BuildError, match="bf16"):  # fp16's refusal names bf16 too
                target.build(request(tmp_path, tiny_onnx, precision))
            assert not ov_engine.engine_dir(tmp_path, request(tmp_path, tiny_onnx, precision).spec).exists()


def test_an_engine_copied_to_a_cpu_without_its_precision_is_refused(tmp_path, tiny_onnx, monkeypatch):
    target = get_target("openvino")
    target.build(request(tmp_path, tiny_onnx))
    engine = target.find(tmp_path, make_spec("openvino"))
    manifest = engine.manifest.model_copy(update={"precision": "bf16", "inference_precision_hint": "bf16"})
    (engine.path / "manifest.json").write_text(manifest.model_dump_json())
    no_bf16 = host.CpuFacts(**{**host.cpu_facts().__dict__, "capabilities": ("FP32", "INT8")})
    monkeypatch.setattr(host, "cpu_facts", lambda: no_bf16)
    with pytest.raises(BuildError, match=r"was built on .*bf16"):
        target.runner(target.find(tmp_path, make_spec("openvino")))


def test_triton_models_python_and_native(tmp_path, tiny_onnx, monkeypatch):
    monkeypatch.delenv("TRT_DIFFUSION_OPENVINO_THREADS", raising=False)  # set for xdist workers (tests/conftest.py)
    target = get_target("openvino")
    target.build(request(tmp_path, tiny_onnx))
    engine = target.find(tmp_path, make_spec("openvino"))
    served = target.triton_model(engine, engine_backend="python")
    assert served.backend == "python" and {"model.xml", "model.bin", "manifest.json",
                                            engine.manifest.cache_blob} <= set(served.files)
    with pytest.raises(ServeError, match=r"HINT_BF16.*--engine-backend python"):
        target.triton_model(engine, engine_backend="native")  # fp32: the backend cannot force f32 on AMX CPUs
    bf16 = type(engine)(engine.spec, engine.path, engine.manifest.model_copy(update={"inference_precision_hint": "bf16"}))
    native = target.triton_model(bf16, engine_backend="native")
    assert native.backend == "openvino" and native.model_file == "model.xml"
    assert dict(native.parameters) == {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "HINT_BF16": "YES"}
    # a python-backend instance gets its share of the cores from its config's instance count
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    for name, source in served.files.items():
        shutil.copy(source, model / "1" / name)
    (model / "config.pbtxt").write_text('name: "m"\ninstance_group {\n  count: 2\n  kind: KIND_CPU\n}\n')
    runner = target.runner_from_files(model / "1", "m")
    assert runner.threads == max(1, host.available_cores() // 2)


def test_a_host_without_openvino_skips_it_and_refuses_target_openvino(tmp_path, monkeypatch, tiny_model_dir,
                                                                       write_engines_yaml):
    import importlib.util

    from trt_diffusion import api

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    reason = availability()["openvino"]
    assert reason and "openvino package is not installed" in reason and "trt-diffusion[openvino]" in reason
    config = allow_openvino_only(write_engines_yaml(tmp_path, tiny_model_dir("sd15"), "sd15", targets=["openvino"]))
    # a build whose every engine is for a target this host cannot build fails, naming why (#31: no silent no-op)
    with pytest.raises(MissingDependencyError, match="nothing to build on this machine") as caught:
        api.build(config)
    assert reason in str(caught.value)
    with pytest.raises(MissingDependencyError, match="cannot build the openvino target on this machine: the openvino package"):
        api.build(config, target="openvino")


def allow_openvino_only(config_path):
    """A file whose only target is openvino: its preflight block (where the schema has one) must name it."""
    from trt_diffusion.engines_file.schema import EnginesFile

    if "preflight" in EnginesFile.model_fields:
        data = yaml.safe_load(config_path.read_text())
        data.setdefault("preflight", {})["target"] = "openvino"
        config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return config_path
