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
import pytest

from trt_diffusion.targets.tensorrt import engine as target
from trt_diffusion.targets.tensorrt.config import EngineManifest, TensorInfo
from trt_diffusion.errors import RefitError

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


def fake_tensorrt() -> types.ModuleType:
    module = types.ModuleType("tensorrt")
    module.__version__ = "10.13.0.35"
    module.Builder = object
    module.ILogger = ILogger
    module.Weights = Weights
    module.Refitter = Refitter
    module.init_libnvinfer_plugins = lambda logger, namespace: True
    return module


@pytest.fixture(autouse=True)
def tensorrt_stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt())
    monkeypatch.setattr(target, "_RECORDING_LOGGER", None)


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
        inputs=(TensorInfo(name="sample", dtype="float32", shape=(2, 4, 8, 8)),),
        outputs=(TensorInfo(name="out", dtype="float32", shape=(2, 64, 16)),),
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
