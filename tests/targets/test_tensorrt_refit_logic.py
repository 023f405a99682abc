"""The refit logic of the TensorRT target, against a stand-in for `tensorrt.Refitter`.

The stand-in follows the documented TensorRT 10 contract (set_named_weights rejects unknown names
and wrong sizes/dtypes; weights TensorRT fused together are reported by get_missing_weights until
all are given; refit_cuda_engine fails while any is missing and reads the weights only then). It
checks what no CPU host can otherwise check: which weights a refit writes, that A -> B -> A leaves
no residue, and that every failure is a RefitError naming the weights. The real refit is covered
by test_tensorrt_gpu.py on a GPU host.
"""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from trt_diffusion.errors import BuildError, RefitError
from trt_diffusion.targets.tensorrt import engine as target
from trt_diffusion.targets.tensorrt import host_probe, plan_load, trt_log
from trt_diffusion.targets.tensorrt.manifest import EngineManifest
from trt_diffusion.tensors import TensorSpec

FUSED_GROUPS = [{"conv.weight", "conv.bias"}]  # e.g. a conv whose kernel and bias TensorRT fused


class DataType:
    def __init__(self, name: str):
        self.name = name


FLOAT = DataType("FLOAT")


class Severity:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)


class ILogger:
    Severity = Severity

    def __init__(self):
        pass


class Weights:
    def __init__(self, dtype: DataType, ptr: int, count: int):
        self.dtype, self.ptr, self.size = dtype, ptr, count

    def read(self) -> np.ndarray:
        buffer = ctypes.cast(self.ptr, ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(buffer, shape=(self.size,)).copy()


class FakeEngine:
    def __init__(self, weights: dict[str, np.ndarray]):
        self.weights = {name: np.asarray(array, np.float32).copy() for name, array in weights.items()}
        self.fail_next_refit = False


class Refitter:
    def __init__(self, engine: FakeEngine, logger):
        self.engine, self.logger, self.pending = engine, logger, {}

    def get_all_weights(self):
        return list(self.engine.weights)

    def get_weights_prototype(self, name):
        size = self.engine.weights[name].size if name in self.engine.weights else -1
        return types.SimpleNamespace(dtype=FLOAT, size=size)

    def set_named_weights(self, name, weights):
        known = name in self.engine.weights
        if not known or weights.size != self.engine.weights[name].size or weights.dtype.name != "FLOAT":
            return False
        self.pending[name] = weights
        return True

    def get_missing_weights(self):
        given = set(self.pending)
        return sorted(n for group in FUSED_GROUPS if group & given for n in group - given)

    def refit_cuda_engine(self):
        if self.get_missing_weights():
            return False
        if self.engine.fail_next_refit:
            self.logger.log(Severity.ERROR, "weights validation failed: NaN in conv.weight")
            return False
        for name, weights in self.pending.items():  # read only now, as TensorRT does
            self.engine.weights[name] = weights.read().reshape(self.engine.weights[name].shape)
        return True


class OnnxParserRefitter:
    """Like TensorRT's: sets every weight the engine can refit from the ONNX file: initializers and
    Constant-node values alike (TensorRT also names weights its parser made); an error for any it lacks."""

    def __init__(self, refitter: Refitter, logger):
        self.refitter, self.errors, self.keep = refitter, [], []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> str:
        return self.errors[index]

    def refit_from_file(self, path: str) -> bool:
        model = onnx.load(path)
        values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Constant":
                values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        for name in self.refitter.get_all_weights():
            if name not in values:
                self.errors.append(f"the ONNX has no weight {name}")
                continue
            array = np.ascontiguousarray(values[name], np.float32)
            self.keep.append(array)
            self.refitter.set_named_weights(name, Weights(FLOAT, array.ctypes.data, array.size))
        return not self.errors


def fake_tensorrt() -> types.ModuleType:
    module = types.ModuleType("tensorrt")
    module.__version__ = "10.13.0.35"
    module.Builder = object
    module.ILogger = ILogger
    module.Weights = Weights
    module.Refitter = Refitter
    module.OnnxParserRefitter = OnnxParserRefitter
    module.init_libnvinfer_plugins = lambda logger, namespace: True
    return module


@pytest.fixture(autouse=True)
def tensorrt_stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    monkeypatch.setattr(trt_log, "_LOGGER", None)


def base_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.standard_normal((8, 4, 3, 3)).astype(np.float32),
        "conv.bias": rng.standard_normal(8).astype(np.float32),
        "onnx::MatMul_42": rng.standard_normal((8, 16)).astype(np.float32),  # a transposed Linear weight
    }


def perturbed(weights: dict[str, np.ndarray], seed: int, names=None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = weights if names is None else names
    return {n: weights[n] + rng.standard_normal(weights[n].shape).astype(np.float32) for n in names}


def make_engine(refit: bool = True) -> target.TensorRTEngine:
    manifest = EngineManifest(
        spec_key="k" * 16, spec_name="tiny.unet.64x64.b2.fp32", tensorrt_version="10.13.0.35",
        compute_capability=(9, 0), device_name="NVIDIA H200", flags={"refit": refit},
        profile_shapes={"sample": ((2, 4, 8, 8),) * 3}, onnx_sha256="0" * 64,
        inputs=(TensorSpec(name="sample", dtype="float32", shape=(2, 4, 8, 8)),),
        outputs=(TensorSpec(name="out", dtype="float32", shape=(2, 64, 16)),),
        plan_bytes=1, build_seconds=0.1,
    )
    return target.TensorRTEngine(plan_path=Path("tiny.plan"), manifest=manifest, engine=FakeEngine(base_weights()))


def assert_weights(engine: target.TensorRTEngine, expected: dict[str, np.ndarray]) -> None:
    assert engine.engine.weights.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_array_equal(engine.engine.weights[name], array, err_msg=name)


def test_refit_writes_every_given_weight():
    engine, base = make_engine(), base_weights()
    lora_b = perturbed(base, seed=1)
    target.refit_engine(engine, lora_b)
    assert_weights(engine, lora_b)
    assert engine.refitted_names == set(lora_b)
    assert target.refittable_weight_names(engine) == sorted(base)


def test_a_b_a_leaves_no_residue():
    engine, base = make_engine(), base_weights()
    target.refit_engine(engine, perturbed(base, seed=1))
    target.refit_to_base(engine, base)
    assert_weights(engine, base)
    assert engine.refitted_names == set()


def test_switching_lora_restores_what_only_the_first_one_changed():
    engine, base = make_engine(), base_weights()
    lora_a = perturbed(base, seed=1, names=["onnx::MatMul_42", "conv.weight", "conv.bias"])
    lora_b = perturbed(base, seed=2, names=["conv.weight", "conv.bias"])
    target.refit_engine(engine, lora_a)
    with pytest.raises(RefitError, match=r"not in this one \(e.g. \['onnx::MatMul_42'\]\)"):
        target.refit_engine(engine, lora_b)  # without base weights A's MatMul would stay
    target.refit_engine(engine, lora_b, base_weights=base)
    assert_weights(engine, {**base, **lora_b})
    assert engine.refitted_names == set(lora_b)


def test_weights_fused_with_the_given_ones_are_needed():
    engine, base = make_engine(), base_weights()
    only_kernel = perturbed(base, seed=3, names=["conv.weight"])
    with pytest.raises(RefitError, match=r"TensorRT also needs weight\(s\) \['conv.bias'\]"):
        target.refit_engine(engine, only_kernel)
    assert_weights(engine, base)  # nothing half-applied

    target.refit_engine(engine, only_kernel, base_weights=base)  # the bias comes from base
    assert_weights(engine, {**base, **only_kernel})


def test_unknown_or_misshapen_weights_are_named():
    engine, base = make_engine(), base_weights()
    with pytest.raises(RefitError) as raised:
        target.refit_engine(engine, {"lora_up.weight": np.ones(3, np.float32), "conv.bias": np.ones(9, np.float32)})
    message = str(raised.value)
    assert "lora_up.weight: the engine has no refittable weight of this name" in message
    assert "conv.bias: 9 values (shape (9,)), the engine holds 8" in message
    assert_weights(engine, base)


def test_refit_of_a_non_refittable_engine_is_refused():
    with pytest.raises(RefitError, match="was not built refittable"):
        target.refit_engine(make_engine(refit=False), perturbed(base_weights(), seed=1))


def test_a_failed_refit_reports_what_tensorrt_said():
    engine, base = make_engine(), base_weights()
    engine.engine.fail_next_refit = True
    with pytest.raises(RefitError, match=r"failed to refit(.|\n)*NaN in conv.weight"):
        target.refit_engine(engine, perturbed(base, seed=1))
    assert engine.refitted_names == set(base)  # possibly half-written: a restore must cover them all


def test_restore_needs_every_refitted_base_weight():
    engine, base = make_engine(), base_weights()
    target.refit_engine(engine, perturbed(base, seed=1))
    partial_base = {n: w for n, w in base.items() if n != "onnx::MatMul_42"}
    with pytest.raises(RefitError, match=r"the base weights lack \['onnx::MatMul_42'\]"):
        target.refit_to_base(engine, partial_base)
    target.refit_to_base(engine, base, names=target.refittable_weight_names(engine))
    assert_weights(engine, base)


# ---------------------------------------------------------------------------------------------
# refit --base through OnnxParserRefitter, and the refit record across save and load
# ---------------------------------------------------------------------------------------------

CONSTANT_WEIGHT = "const::scale_3"  # a Constant-node value TensorRT refits, which is no ONNX initializer


def engine_weights() -> dict[str, np.ndarray]:
    return {**base_weights(), CONSTANT_WEIGHT: np.linspace(0.5, 1.5, 8, dtype=np.float32)}


def base_onnx(path: Path) -> Path:
    """An ONNX holding the engine's base weights: three initializers and one Constant node."""
    weights = base_weights()
    constant = helper.make_node("Constant", [], [CONSTANT_WEIGHT],
                                value=numpy_helper.from_array(engine_weights()[CONSTANT_WEIGHT]))
    graph = helper.make_graph(
        [constant, helper.make_node("Identity", [CONSTANT_WEIGHT], ["out"])], "base", [],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [8])],
        initializer=[numpy_helper.from_array(array, name) for name, array in weights.items()])
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_refit_from_base_restores_weights_no_initializer_list_holds(tmp_path):
    from trt_diffusion.onnx_facts import read_base_weights

    onnx_path = base_onnx(tmp_path / "model.onnx")
    engine = make_engine()
    engine.engine = FakeEngine(engine_weights())
    lora_a = perturbed(engine_weights(), seed=1)  # touches the Constant-node weight too
    target.refit_engine(engine, lora_a)
    # the initializers alone cannot restore it: that was `refit --base` before OnnxParserRefitter
    with pytest.raises(RefitError, match=r"the base weights lack \['const::scale_3'\]"):
        target.refit_to_base(engine, read_base_weights(onnx_path))

    target.refit_from_base(engine, onnx_path)
    assert_weights(engine, engine_weights())
    assert engine.refitted_names == set()

    lora_b = perturbed(base_weights(), seed=2, names=["conv.weight", "conv.bias"])
    target.refit_engine(engine, lora_a)
    target.refit_from_base(engine, onnx_path, lora_b)  # B over base: nothing of A stays
    assert_weights(engine, {**engine_weights(), **lora_b})
    assert engine.refitted_names == set(lora_b)


def test_refit_from_a_foreign_onnx_is_refused_with_the_parser_words(tmp_path):
    graph = helper.make_graph([], "other", [], [], initializer=[
        numpy_helper.from_array(np.zeros(8, np.float32), "conv.bias")])
    other = tmp_path / "other.onnx"
    onnx.save(helper.make_model(graph), str(other))
    with pytest.raises(RefitError, match=r"cannot restore engine .* the ONNX has no weight conv.weight"):
        target.refit_from_base(make_engine(), other)


class PickledPlans:
    """Plans as bytes that carry their weights, so a saved plan loads back with what it was saved with."""

    @staticmethod
    def serialize(engine: FakeEngine) -> bytes:
        import pickle

        return pickle.dumps(engine.weights)

    @staticmethod
    def deserialize(plan: bytes, manifest, allow_host_code=False) -> FakeEngine:
        import pickle

        return FakeEngine(pickle.loads(plan))


@pytest.fixture
def built_plan(tmp_path, monkeypatch):
    """A refittable plan and manifest as `build` leaves them, a host that loads it, and the target."""
    import trt_diffusion.targets.tensorrt as trt_target
    from trt_diffusion.targets.base import BuiltEngine
    from trt_diffusion.targets.tensorrt.manifest import manifest_path

    monkeypatch.setattr(FakeEngine, "serialize", lambda self: PickledPlans.serialize(self), raising=False)
    monkeypatch.setattr(FakeEngine, "create_serialization_config", lambda self: SerializationConfig(set()),
                        raising=False)
    monkeypatch.setattr(FakeEngine, "serialize_with_config", serialize_with_config, raising=False)
    monkeypatch.setattr(sys.modules["tensorrt"], "SerializationFlag",
                        types.SimpleNamespace(EXCLUDE_WEIGHTS="EXCLUDE_WEIGHTS"), raising=False)
    monkeypatch.setattr(plan_load, "_deserialize", PickledPlans.deserialize)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: sys.modules["tensorrt"])
    monkeypatch.setattr(host_probe, "host_info", lambda device_index=0: ("10.13.0.35", (9, 0), "NVIDIA H200"))
    lora = types.ModuleType("trt_diffusion.lora")  # the LoRA -> initializer mapping is tested in tests/lora
    lora.RefitMap = types.SimpleNamespace(load=lambda path, onnx_path: None)
    lora.refit_weights_for_tensorrt = lambda refit_map, weights, precision: dict(weights)
    monkeypatch.setitem(sys.modules, "trt_diffusion.lora", lora)

    plan = tmp_path / "engines" / "tiny.plan"
    plan.parent.mkdir()
    plan.write_bytes(PickledPlans.serialize(FakeEngine(engine_weights())))
    onnx_path = base_onnx(tmp_path / "model.onnx")
    from trt_diffusion.onnx_facts import onnx_sha256
    from trt_diffusion.targets.tensorrt.plan_trust import plan_sha256

    manifest = make_engine().manifest.model_copy(update={
        "plan_bytes": plan.stat().st_size, "plan_sha256": plan_sha256(plan.read_bytes()),
        "onnx_sha256": onnx_sha256(onnx_path)})
    manifest.write(manifest_path(plan))

    def reload() -> BuiltEngine:
        from trt_diffusion.targets.tensorrt.manifest import EngineManifest

        return BuiltEngine(spec=types.SimpleNamespace(precision="fp32", name="tiny", key="k" * 16,
                                                      option=lambda name, default=None: default), path=plan,
                           manifest=EngineManifest.read(manifest_path(plan)))

    return trt_target.TensorRTTarget(), reload, onnx_path


def test_a_refitted_lora_is_recorded_and_replaced_from_base_by_the_next_refit(built_plan):
    from trt_diffusion.targets.tensorrt.refit_weights import weights_digest

    trt_target, reload, onnx_path = built_plan
    lora_a = perturbed(engine_weights(), seed=1)  # every weight, the Constant-node one included
    assert trt_target.refit(reload(), lora_a, lambda: onnx_path) == 4

    saved = reload().manifest  # what a later process sees
    assert not saved.is_base and saved.refit.in_progress is False
    assert saved.refit.names == tuple(sorted(lora_a)) and saved.refit.weights_sha256 == weights_digest(lora_a)
    loaded = target.load_engine(reload().path)
    assert_weights(loaded, lora_a)
    assert loaded.refitted_names == set(lora_a)  # restore on load covers A's weights

    lora_b = perturbed(base_weights(), seed=2, names=["conv.weight", "conv.bias"])
    trt_target.refit(reload(), lora_b, lambda: onnx_path)  # a new process: only the plan and manifest survive
    assert_weights(target.load_engine(reload().path), {**engine_weights(), **lora_b})  # none of A left
    assert reload().manifest.refit.names == ("conv.bias", "conv.weight")

    assert trt_target.refit(reload(), None, lambda: onnx_path) == 0  # refit --base
    assert reload().manifest.is_base and reload().manifest.refit is None
    assert_weights(target.load_engine(reload().path), engine_weights())


def test_an_interrupted_refit_never_leaves_a_plan_that_passes_for_base(built_plan, monkeypatch):
    from trt_diffusion.workspace import files

    trt_target, reload, onnx_path = built_plan
    real_write = files.atomic_write_bytes

    def crash_on_plan(path, data):
        if str(path).endswith(".plan"):
            raise KeyboardInterrupt("killed while writing the plan")
        real_write(path, data)

    monkeypatch.setattr(files, "atomic_write_bytes", crash_on_plan)
    with pytest.raises(KeyboardInterrupt):
        trt_target.refit(reload(), perturbed(engine_weights(), seed=1), lambda: onnx_path)
    manifest = reload().manifest
    assert manifest.refit is not None and manifest.refit.in_progress is True
    assert not manifest.is_base  # `build` rebuilds it; the next `refit` restores every weight from the ONNX
    # #27 item 4: nothing loads it for inference; `refit` (from the ONNX) takes the plan as it is and repairs it
    with pytest.raises(BuildError, match="refit of its plan was interrupted"):
        target.load_engine(reload().path)
    monkeypatch.setattr(files, "atomic_write_bytes", real_write)
    assert trt_target.refit(reload(), None, lambda: onnx_path) == 0
    assert reload().manifest.is_base
    assert_weights(target.load_engine(reload().path), engine_weights())


# ---------------------------------------------------------------------------------------------
# #45: stripped plans (STRIP_PLAN) and REFIT_IDENTICAL
# ---------------------------------------------------------------------------------------------


class SerializationConfig:
    """`ISerializationConfig` as NvInferRuntime.h describes it: a stripped build's default config holds
    EXCLUDE_WEIGHTS."""

    def __init__(self, flags: set[str]):
        self.flags = set(flags)

    def clear_flag(self, flag: str) -> bool:
        self.flags.discard(flag)
        return True


def serialize_with_config(self, config):
    import pickle

    weights = self.weights if "EXCLUDE_WEIGHTS" not in config.flags else {
        n: np.zeros_like(a) for n, a in self.weights.items()}
    return pickle.dumps(weights)


def stripped_plans(monkeypatch):
    """A stripped build's plans: `serialize()` and the default serialization config leave the weights out (zeros
    here, the names kept); only a config with EXCLUDE_WEIGHTS cleared saves them."""
    monkeypatch.setattr(FakeEngine, "create_serialization_config",
                        lambda self: SerializationConfig({"EXCLUDE_WEIGHTS"}), raising=False)
    monkeypatch.setattr(FakeEngine, "serialize", lambda self: serialize_with_config(
        self, self.create_serialization_config()), raising=False)


def test_a_lora_refitted_into_a_stripped_plan_is_saved_with_its_weights_and_survives_a_load(built_plan, monkeypatch):
    """#45 item 1: `refit` saved a stripped plan stripped again (`serialize()` keeps EXCLUDE_WEIGHTS); the load then
    refitted the base weights from the ONNX over it: the LoRA the manifest records was silently lost."""
    from trt_diffusion.targets.tensorrt.manifest import EngineManifest, manifest_path

    trt_target, reload, onnx_path = built_plan
    stripped_plans(monkeypatch)
    path = reload().path
    manifest = EngineManifest.read(manifest_path(path))
    manifest.model_copy(update={"flags": {"refit": True, "strip_plan": True}}).write(manifest_path(path))
    lora = perturbed(engine_weights(), seed=1, names=["conv.weight", "conv.bias"])
    assert trt_target.refit(reload(), lora, lambda: onnx_path) == 2
    assert not reload().manifest.stripped  # the plan holds its weights now: loaded as it is
    assert_weights(target.load_engine(path, weights_onnx=onnx_path), {**engine_weights(), **lora})  # as packaged
    assert_weights(target.load_engine(path), {**engine_weights(), **lora})  # no ONNX needed any more

    assert trt_target.refit(reload(), None, lambda: onnx_path) == 0  # refit --base: a stripped plan again
    assert reload().manifest.stripped
    with pytest.raises(BuildError, match="stripped plan"):
        target.load_engine(path)
    assert_weights(target.load_engine(path, weights_onnx=onnx_path), engine_weights())


def test_a_refit_identical_stripped_plan_takes_its_own_weights_back_but_no_lora(tmp_path):
    """#45 item 4: a stripped plan built without REFIT is REFIT_IDENTICAL (build_flags): refitting any other weights
    is undefined in TensorRT, yet `_refitter` accepted `strip_plan` alone. Restoring its build weights from its
    ONNX (what loading it does) stays allowed."""
    engine = make_engine(refit=False)
    engine.manifest = engine.manifest.model_copy(update={"flags": {"refit": False, "strip_plan": True}})
    engine.engine = FakeEngine(engine_weights())
    lora = perturbed(base_weights(), seed=1, names=["conv.weight", "conv.bias"])
    for refit in (lambda: target.refit_engine(engine, lora),
                  lambda: target.refit_from_base(engine, base_onnx(tmp_path / "m.onnx"), lora)):
        with pytest.raises(RefitError, match="REFIT_IDENTICAL.*never a LoRA"):
            refit()
    assert_weights(engine, engine_weights())
    target.refit_from_base(engine, base_onnx(tmp_path / "m.onnx"))  # its own weights: allowed
    assert_weights(engine, engine_weights())
