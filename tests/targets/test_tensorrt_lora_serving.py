"""#45 item 12: LoRA per request on TensorRT, on CPU.

NO REAL PART OF TENSORRT OR CUDA RUNS HERE. A repository is packaged with a refittable TensorRT UNet and LoRA parts;
its engine model (triton/backend/engine_model.py, as the python backend runs it) is initialized and executed in
process over the stub-generated TensorRT stand-in (tests/shared/tensorrt_stub_fake.py), a Refitter generated from
the same stubs that reads device weights only when the stream runs, and the asynchronous fake CUDA
(tests/shared/tensorrt_async_cuda.py). The engine's output is `sample + sum(w) + sum(b)`: each response shows which
weights the engine held when that request ran. Checked: the served contract the other targets pass (each set equals
base + scale * delta, A -> B -> A and back to base exact, the LRU of `--lora-cache-sets` evicts least recently used
first on the host and on the GPU, one request's set never reaching another's run, the switch metrics), and the
refusals (fp8/int8 and non-REFIT engines at `package`).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size
from trt_diffusion.targets.base import BuiltEngine
from trt_diffusion.targets.tensorrt import engine as trt_engine
from trt_diffusion.targets.tensorrt import engine_group, host_probe, plan_load, trt_log
from trt_diffusion.targets.tensorrt.build_flags import BuildFlags
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, engine_path, manifest_path
from trt_diffusion.tensors import TensorSpec

fake = pytest.importorskip("tensorrt_stub_fake")
if fake.stub_path() is None:
    pytest.skip(f"tensorrt-stubs are not installed (pip install --no-deps {fake.STUB_PACKAGE})", allow_module_level=True)

HOST = ("10.13.0.35", (9, 0), "NVIDIA H200")
SHAPE = (1, 4, 8, 8)
RNG = np.random.default_rng(0)
BASE = {"conv.weight": RNG.standard_normal(64).astype(np.float32), "conv.bias": RNG.standard_normal(8).astype(np.float32)}
DELTAS = {"a": {"conv.weight": np.full(64, 0.5, np.float32)},
          "b": {"conv.weight": np.full(64, -0.25, np.float32), "conv.bias": np.full(8, 2.0, np.float32)},
          "c": {"conv.bias": np.full(8, -1.0, np.float32)}}
ONNX_NAMES = {"conv.weight": "w", "conv.bias": "b"}  # what the refit map says


def _t(name, *shape):
    return TensorSpec(name=name, dtype="float32", shape=tuple(shape))


def _engine(workspace: Path, component: str, inputs, outputs, *, bucket=None, refittable=False,
            precision="fp32") -> BuiltEngine:
    from trt_diffusion.lora import MatchedBy, RefitMap, RefitTarget

    spec = EngineSpec(model="tiny", family="sd15", source="/m", component=component, target="tensorrt",
                      precision=precision, batch=1, bucket=bucket, refittable=refittable)
    plan = engine_path(workspace, spec)
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_bytes(b"plan of " + component.encode())
    refit_map = None
    if refittable:
        refit_map = plan.with_name(plan.stem + ".refit_map.json")
        RefitMap(onnx_sha256="0" * 64, targets={
            param: RefitTarget(initializer=ONNX_NAMES[param], transpose=False, shape=value.shape, dtype="float32",
                               matched_by=MatchedBy.name) for param, value in BASE.items()}).save(refit_map)
    manifest = EngineManifest(
        spec_key=spec.key, spec_name=spec.name, tensorrt_version=HOST[0], compute_capability=HOST[1],
        device_name=HOST[2], flags=BuildFlags.for_spec(spec, precision in ("fp8", "int8")).to_dict(),
        profile_shapes={inputs[0].name: (inputs[0].shape,) * 3}, onnx_sha256="0" * 64, inputs=tuple(inputs),
        outputs=tuple(outputs), plan_bytes=plan.stat().st_size, plan_sha256=hashlib.sha256(plan.read_bytes()).hexdigest(),
        build_seconds=0, refit_map=str(refit_map) if refit_map else None)
    manifest.write(manifest_path(plan))
    return BuiltEngine(spec, plan, manifest)


def _engines(workspace: Path, **unet) -> list[BuiltEngine]:
    bucket = Bucket.static(Size(64, 64))
    return [_engine(workspace, "text_encoder", [_t("input_ids", 1, 77)], [_t("hidden_states", 1, 77)]),
            _engine(workspace, "unet", [_t("sample", *SHAPE)], [_t("noise_pred", *SHAPE)], bucket=bucket,
                    refittable=True, **unet),
            _engine(workspace, "vae_decoder", [_t("latent", *SHAPE)], [_t("images", *SHAPE)], bucket=bucket)]


def _parts(folder: Path):
    """What triton/lora_parts.write_parts writes for the UNet: base values and each LoRA's delta (torch names)."""
    from safetensors.numpy import save_file

    from trt_diffusion.targets.lora_switch import BASE_FILE, INDEX_FILE, SCHEMA_VERSION
    from trt_diffusion.triton.lora_parts import ComponentParts
    from trt_diffusion.workspace.files import sha256_file

    folder.mkdir(parents=True)
    save_file(BASE, str(folder / BASE_FILE))
    for name, delta in DELTAS.items():
        save_file(delta, str(folder / f"lora-{name}.safetensors"))
    index = {"schema_version": SCHEMA_VERSION, "component": "unet",
             "base": {"file": BASE_FILE, "sha256": sha256_file(folder / BASE_FILE)},
             "loras": {name: {"file": f"lora-{name}.safetensors", "source": name, "parameters": len(DELTAS[name]),
                              "sha256": sha256_file(folder / f"lora-{name}.safetensors")} for name in DELTAS}}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return {"unet": ComponentParts("unet", folder, tuple(sorted(DELTAS)))}


def _expected(sample, chosen: dict[str, float]) -> np.ndarray:
    weights = {p: v.astype(np.float32, copy=True) for p, v in BASE.items()}
    for name, scale in sorted(chosen.items()):
        for param, delta in DELTAS[name].items():
            weights[param] += np.float32(scale) * delta
    return sample + weights["conv.weight"].sum() + weights["conv.bias"].sum()


def _refitter_module(trt, cudart, stored: dict, log: list):
    """`tensorrt` for the refit calls: a Refitter generated from the stubs that takes device weights only; its
    `refit_cuda_engine_async` queues on the stream a read of every weight it was given (from device memory that
    must still be allocated when the stream runs)."""
    classes = trt.classes
    data_type, location = fake.make_enum(classes["DataType"]), fake.make_enum(classes["TensorLocation"])

    class Weights:
        def __init__(self, dtype, ptr, count):
            self.dtype, self.ptr, self.count = dtype, ptr, count

    def behaviours():
        def get_weights_prototype(self, weights_name):
            return SimpleNamespace(dtype=data_type.FLOAT, size=stored[weights_name].size if weights_name in stored
                                   else -1)

        def set_named_weights(self, name, weights, location):
            if location is not device or name not in stored:
                return False
            self._pending[name] = weights
            return True

        def get_missing_weights(self):
            return []

        def refit_cuda_engine_async(self, stream_handle):
            pending = dict(self._pending)

            def refit():
                for name, weights in pending.items():
                    stored[name] = cudart.read(weights.ptr, np.float32, (weights.count,)).copy()

            cudart.enqueue(stream_handle, "refit", refit)
            log.append("refit")
            return True

        return fake._functions(locals())

    device = location.DEVICE
    refitter = fake.make_class(classes["Refitter"], behaviours())
    refitter.__init__ = lambda self, engine, logger: object.__setattr__(self, "_pending", {})
    module = types.ModuleType("tensorrt")
    module.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    module.Refitter, module.Weights, module.TensorLocation, module.DataType = refitter, Weights, location, data_type
    return module


class _Metric:
    def __init__(self, counts, labels):
        self.counts, self.key = counts, tuple(sorted(labels.items()))

    def increment(self, value):
        self.counts[self.key] = self.counts.get(self.key, 0) + value


class _Utils:
    """The python backend's utils as far as the engine model uses them."""

    counts: dict = {}

    class TritonError:
        INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

        def __init__(self, message, code=None):
            self.message, self.code = message, code

    class Logger:
        @staticmethod
        def log_error(text):
            raise AssertionError(f"internal error: {text}")

        log_warn = log_error

    class InferenceResponse:
        def __init__(self, tensors=(), error=None):
            self.tensors, self.error = list(tensors), error

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):  # noqa: N802 - the backend's name
            return _Metric(_Utils.counts, {"family": self.name, **labels})

    @staticmethod
    def Tensor(name, value):  # noqa: N802 - the backend's name
        return (name, value)


class _Request(dict):
    def __init__(self, feeds, loras=None):
        from trt_diffusion.triton.contract import LORAS_PARAMETER

        super().__init__(feeds)
        chosen = [{"name": n, "scale": s} for n, s in (loras or {}).items()]
        self._parameters = json.dumps({LORAS_PARAMETER: json.dumps(chosen)} if loras else {})

    def parameters(self):
        return self._parameters


@pytest.fixture
def served(tmp_path, tiny_model_factory, monkeypatch):
    """The packaged UNet engine model, initialized as the python backend does, over the fakes."""
    from google.protobuf import json_format
    from tensorrt_async_cuda import AsyncCudart

    from trt_diffusion.targets.tensorrt import runner as trt_runner
    from trt_diffusion.targets.tensorrt.cudart import Cuda
    from trt_diffusion.triton import configs
    from trt_diffusion.triton.backend import engine_model, pb
    from trt_diffusion.triton.repository import PackageOptions, package

    repo = tmp_path / "repo"
    report = package(_engines(tmp_path / "ws"), tiny_model_factory("sd15"), "sd15", "tiny", repo,
                     PackageOptions(ensemble=False, stream=False, lora_cache_sets=2),
                     loras=_parts(tmp_path / "parts"), served_loras=tuple(sorted(DELTAS)))
    trt, cudart = fake.FakeTensorRT(), AsyncCudart()
    stored = {ONNX_NAMES[p]: v.copy() for p, v in BASE.items()}  # the weights the engine holds
    log: list[str] = []
    module = _refitter_module(trt, cudart, stored, log)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: trt)  # the stub-generated enums
    monkeypatch.setattr(trt_log, "trt_logger", lambda: None)
    group = trt_runner.EngineGroup(cuda=Cuda(cudart), bound_bytes=1 << 30)
    monkeypatch.setattr(engine_group, "default_group", lambda device=None: group)

    def compute(feeds):  # runs when the stream runs: after every refit queued before it
        log.append("run")
        return {"noise_pred": feeds["sample"] + stored["w"].sum() + stored["b"].sum()}

    def load_engine(plan, **kwargs):
        description = fake.EngineDescription(
            inputs={"sample": ("FLOAT", SHAPE, SHAPE, SHAPE)}, outputs={"noise_pred": "FLOAT"},
            output_shape=lambda shapes: {"noise_pred": SHAPE}, compute=compute)
        return trt_engine.TensorRTEngine(Path(plan), EngineManifest.read(manifest_path(plan)),
                                         trt.engine(description, cudart))

    monkeypatch.setattr(plan_load, "load_engine", load_engine)
    monkeypatch.setattr(pb, "utils", lambda: _Utils)
    monkeypatch.setattr(pb, "input_array", lambda request, name: request[name])
    _Utils.counts = {}
    name = "tiny__unet__64x64__b1"
    config = json_format.MessageToDict(configs.parse((repo / name / "config.pbtxt").read_text(), name),
                                       preserving_proto_field_name=True)
    instance = engine_model.TritonPythonModel()
    instance.initialize({"model_config": json.dumps(config), "model_repository": str(repo / name),
                         "model_version": "1", "model_instance_kind": "GPU", "model_instance_device_id": "0"})
    return SimpleNamespace(instance=instance, repo=repo, name=name, config=config, report=report, cudart=cudart,
                           group=group, log=log, stored=stored)


def _call(served, loras=None, seed=0):
    sample = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    (response,) = served.instance.execute([_Request({"sample": sample}, loras)])
    assert response.error is None, response.error.message
    return sample, dict(response.tensors)


def test_a_tensorrt_engine_serves_lora_sets_per_request_through_its_engine_model(served):
    from trt_diffusion.targets.tensorrt.runner import TensorRTRunner

    version = served.repo / served.name / "1"
    assert served.config.get("backend") == "python" and not served.config.get("platform")  # not tensorrt_plan
    assert {"model.plan", "manifest.json", "refit_map.json", "loras", "model.py"} <= {p.name for p in version.iterdir()}
    assert any("device-resident LoRA sets" in note for note in served.report.notes)

    requests = [{}, {"a": 1.0}, {"b": 0.5, "a": 0.25}, {"a": 1.0}, {}, {"c": 2.0}, {"b": 0.5, "a": 0.25}, {"a": 1.0}]
    for seed, chosen in enumerate(requests):
        sample, out = _call(served, chosen, seed)
        np.testing.assert_allclose(out["noise_pred"], _expected(sample, chosen), rtol=1e-6, atol=1e-5,
                                   err_msg=str(chosen))
        assert "LORA_SWITCH_S" in out
    # A -> B -> A and back to base are exact: from the base values and the same device copies every time
    _, first_a = _call(served, {"a": 1.0}, seed=99)
    _call(served, {"c": 2.0}, seed=99)
    _, again_a = _call(served, {"a": 1.0}, seed=99)
    np.testing.assert_array_equal(first_a["noise_pred"], again_a["noise_pred"])
    _call(served, {}, seed=0)
    assert all(np.array_equal(served.stored[ONNX_NAMES[p]], v) for p, v in BASE.items())

    switching = served.instance.runner
    base = switching.base
    assert isinstance(base, TensorRTRunner) and base.serving_loras
    assert len(switching.applied) <= 2 and base._resident.capacity == 2  # --lora-cache-sets on host and GPU
    assert len(base._resident.digests) <= 2
    counts = {dict(k)["result"]: v for k, v in _Utils.counts.items()}
    # a, b+a, c, b+a (a evicted it), a (c evicted it), c: refits; a twice from the cache; base twice
    assert counts == {"refit": 6, "cached": 2, "base": 2}


def test_lru_eviction_frees_the_device_set_and_a_set_never_reaches_another_requests_run(served):
    runner = served.instance.runner
    base = runner.base
    _call(served, {"a": 1.0})
    _call(served, {"b": 1.0})
    frees = base.stats.extra["resident_frees"]
    _call(served, {"c": 1.0})  # a third set with room for two: a (least recently used) leaves host and GPU
    assert base.stats.extra["resident_frees"] > frees
    assert len(base._resident.digests) == 2 and len(runner.applied) == 2
    assert (("a", 1.0),) not in runner.applied
    # interleaved requests: every run holds exactly its own request's weights (the refit is queued before it)
    served.log.clear()
    sequence = [{"a": 1.0}, {}, {"c": 1.0}, {"c": 1.0}, {"b": 1.0}, {}]
    for seed, chosen in enumerate(sequence):
        sample, out = _call(served, chosen, seed)
        np.testing.assert_allclose(out["noise_pred"], _expected(sample, chosen), rtol=1e-6, atol=1e-5)
    assert served.log == ["refit", "run", "refit", "run", "refit", "run", "run", "refit", "run", "refit", "run"]
    assert served.cudart.live_device > 0
    base.deactivate()  # the engine unloads: every resident set and base copy is freed with it
    assert not base._resident.digests and not base._resident_base


def test_quantized_or_non_refit_tensorrt_engines_are_refused_at_package(tmp_path, tiny_model_factory):
    from trt_diffusion.triton.repository import PackageOptions, package

    for precision, reason in (("int8", "int8 TensorRT engine: a LoRA there needs its weight scales recomputed"),):
        report = package(_engines(tmp_path / precision, precision=precision), tiny_model_factory("sd15"), "sd15",
                         "tiny", tmp_path / f"repo-{precision}", PackageOptions(ensemble=False, stream=False),
                         loras=_parts(tmp_path / f"parts-{precision}"), served_loras=tuple(sorted(DELTAS)))
        assert any(reason in note for note in report.notes), report.notes
        unet = tmp_path / f"repo-{precision}" / "tiny__unet__64x64__b1" / "1"
        assert not (unet / "loras").exists() and (unet / "model.plan").is_file()
