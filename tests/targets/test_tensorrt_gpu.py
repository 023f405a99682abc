"""The TensorRT target on a real GPU: build a tiny conv+matmul engine, run it against ONNX Runtime,
refit it (A -> B -> A), and refuse a plan whose manifest names another TensorRT or GPU.

Marked `gpu`: left out of the default run; `-m gpu` on a host without TensorRT or a CUDA device fails
every test with the reason (a GPU suite that skips itself protects nothing). These engines are tiny so
the whole module runs in well under a minute on a GPU host.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.gpu

from trt_diffusion.targets.tensorrt import engine as target  # noqa: E402


@pytest.fixture(autouse=True)
def _tensorrt_and_a_gpu():
    available, reason = target.tensorrt_available()
    if not available:
        pytest.fail(f"the gpu suite needs TensorRT and a CUDA device: {reason}", pytrace=False)


import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from trt_diffusion.targets.tensorrt.config import (  # noqa: E402
    REBUILD_COMMAND,
    engine_path,
    manifest_path,
    read_base_weights,
    timing_cache_path,
)
from trt_diffusion.errors import BuildError, RefitError, RuntimeInputError  # noqa: E402
from trt_diffusion.spec.engine_spec import Bucket, EngineSpec, Size  # noqa: E402

STATIC = {"sample": ((2, 4, 8, 8),) * 3}
RANGE = {"sample": ((1, 4, 8, 8), (2, 4, 16, 16), (4, 4, 32, 32))}


class TinyConvMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.silu(self.conv(sample))
        tokens = hidden.flatten(2).transpose(1, 2)  # (batch, height*width, 8)
        return self.proj(tokens)  # exported as MatMul with a transposed, renamed weight


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = TinyConvMatmul().eval()
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    with torch.no_grad():
        torch.onnx.export(
            model, (torch.randn(2, 4, 8, 8),), str(path),
            input_names=["sample"], output_names=["out"],
            dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"}, "out": {0: "batch", 1: "tokens"}},
            opset_version=17, dynamo=False,
        )
    return path


@pytest.fixture(scope="module")
def qdq_onnx(tmp_path_factory) -> Path:
    """x -> Q -> DQ -> Conv(DQ(int8 weight)): explicit int8 quantization."""
    rng = np.random.default_rng(1)
    initializers = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x.scale"),
        numpy_helper.from_array(np.array(0, np.int8), "x.zero_point"),
        numpy_helper.from_array(rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8), "conv.weight_q"),
        numpy_helper.from_array(np.array(0.01, np.float32), "w.scale"),
        numpy_helper.from_array(np.array(0, np.int8), "w.zero_point"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["sample", "x.scale", "x.zero_point"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x.scale", "x.zero_point"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["conv.weight_q", "w.scale", "w.zero_point"], ["w_dq"]),
        helper.make_node("Conv", ["x_dq", "w_dq"], ["out"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_qdq",
        [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [2, 4, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8, 8, 8])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    path = tmp_path_factory.mktemp("onnx") / "qdq.onnx"
    onnx.save(model, str(path))
    return path


def tiny_spec(precision: str, refittable: bool = False) -> EngineSpec:
    return EngineSpec(
        model="tiny", family="sd15", source="tests/tiny", component="unet", target="tensorrt",
        precision=precision, batch=2, bucket=Bucket.static(Size(64, 64)), refittable=refittable,
        # TF32 off: fp32 engines are compared with ONNX Runtime to 1e-4
        build_options=(("tensorrt_optimization_level", 3), ("tensorrt_tf32", False), ("tensorrt_workspace_gb", 1)),
    )


def build(workspace: Path, onnx_path: Path, spec: EngineSpec, profile: dict) -> tuple[Path, object]:
    plan = engine_path(workspace, spec)
    manifest = target.build_engine(onnx_path, spec, profile, plan, workspace / "timing-cache")
    return plan, manifest


def onnxruntime_out(onnx_path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return session.run(["out"], feeds)[0]


def sample(shape, seed: int = 0) -> dict[str, np.ndarray]:
    return {"sample": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def with_initializers(onnx_path: Path, weights: dict[str, np.ndarray], out: Path) -> Path:
    model = onnx.load(str(onnx_path))
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.name in weights:
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(weights[tensor.name], tensor.name))
    onnx.save(model, str(out))
    return out


def test_fp32_engine_matches_onnxruntime(tiny_onnx, tmp_path):
    import tensorrt as trt

    plan, manifest = build(tmp_path, tiny_onnx, tiny_spec("fp32"), STATIC)
    trt_version, compute_capability, _ = target.host_info()
    assert plan.is_file() and manifest_path(plan).is_file()
    assert manifest.tensorrt_version == trt.__version__
    assert tuple(manifest.compute_capability) == compute_capability
    assert (manifest.flags["fp16"], manifest.flags["strongly_typed"], manifest.flags["refit"]) == (False, False, False)
    assert [(t.name, t.dtype) for t in manifest.inputs] == [("sample", "float32")]
    assert [(t.name, t.dtype) for t in manifest.outputs] == [("out", "float32")]
    assert manifest.plan_bytes == plan.stat().st_size
    assert timing_cache_path(tmp_path / "timing-cache", compute_capability, trt_version).stat().st_size > 0

    feeds = sample((2, 4, 8, 8))
    got = target.run_engine(plan, feeds)["out"]
    np.testing.assert_allclose(got, onnxruntime_out(tiny_onnx, feeds), atol=1e-4, rtol=0)


def test_fp16_range_engine_matches_onnxruntime(tiny_onnx, tmp_path):
    plan, manifest = build(tmp_path, tiny_onnx, tiny_spec("fp16"), RANGE)
    assert manifest.flags["fp16"] is True
    assert manifest.profile_shapes["sample"] == RANGE["sample"]
    engine = target.load_engine(plan)
    for seed, shape in enumerate([(1, 4, 8, 8), (2, 4, 16, 16), (4, 4, 32, 32), (3, 4, 8, 24)]):
        feeds = sample(shape, seed)
        expected = onnxruntime_out(tiny_onnx, feeds)
        got = target.run_engine(engine, feeds)["out"]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got.astype(np.float32), expected, atol=1e-2, rtol=0)
    with pytest.raises(RuntimeInputError, match=r"outside the engine's profile \(1, 4, 8, 8\)..\(4, 4, 32, 32\)"):
        target.run_engine(engine, sample((8, 4, 8, 8)))


def test_refit_to_b_and_back_to_a(tiny_onnx, tmp_path):
    plan, _ = build(tmp_path, tiny_onnx, tiny_spec("fp32", refittable=True), STATIC)
    engine = target.load_engine(plan)
    base = read_base_weights(tiny_onnx)
    refittable = target.refittable_weight_names(engine)
    assert "conv.weight" in refittable
    assert set(base) <= set(refittable), "refit maps assume every ONNX float initializer is refittable by name"

    feeds = sample((2, 4, 8, 8))
    outputs_a = target.run_engine(engine, feeds)["out"]
    np.testing.assert_allclose(outputs_a, onnxruntime_out(tiny_onnx, feeds), atol=1e-4, rtol=0)

    rng = np.random.default_rng(7)
    weights_b = {n: (w + 0.1 * rng.standard_normal(w.shape)).astype(w.dtype) for n, w in base.items()}
    expected_b = onnxruntime_out(with_initializers(tiny_onnx, weights_b, tmp_path / "tiny_b.onnx"), feeds)
    assert np.abs(expected_b - outputs_a).max() > 0.1  # B really changes the output

    target.refit_engine(engine, weights_b)
    np.testing.assert_allclose(target.run_engine(engine, feeds)["out"], expected_b, atol=1e-4, rtol=0)

    with pytest.raises(RefitError, match="changed by an earlier refit"):
        target.refit_engine(engine, {"conv.weight": base["conv.weight"]})  # would leave B's other weights

    target.refit_to_base(engine, base)
    np.testing.assert_array_equal(target.run_engine(engine, feeds)["out"], outputs_a)


def test_non_refittable_engine_refuses_refit(tiny_onnx, tmp_path):
    plan, _ = build(tmp_path, tiny_onnx, tiny_spec("fp16"), STATIC)
    with pytest.raises(RefitError, match="not built refittable"):
        target.refit_engine(target.load_engine(plan), read_base_weights(tiny_onnx))


def test_plan_with_mismatched_manifest_is_refused(tiny_onnx, tmp_path):
    plan, manifest = build(tmp_path, tiny_onnx, tiny_spec("fp32"), STATIC)
    target.load_engine(plan)  # as built, it loads

    manifest.model_copy(update={"tensorrt_version": "9.3.0.1"}).write(manifest_path(plan))
    with pytest.raises(BuildError, match=r"built with TensorRT 9.3.0.1") as raised:
        target.load_engine(plan)
    assert REBUILD_COMMAND in str(raised.value)

    manifest.model_copy(update={"compute_capability": (1, 0)}).write(manifest_path(plan))
    with pytest.raises(BuildError, match=r"for sm_10 .*compute capability"):
        target.load_engine(plan)


def test_qdq_onnx_builds_a_strongly_typed_engine(qdq_onnx, tmp_path):
    plan, manifest = build(tmp_path, qdq_onnx, tiny_spec("int8"), STATIC)
    assert manifest.flags["strongly_typed"] is True
    assert (manifest.flags["fp16"], manifest.flags["bf16"]) == (False, False)
    feeds = sample((2, 4, 8, 8))
    np.testing.assert_allclose(target.run_engine(plan, feeds)["out"], onnxruntime_out(qdq_onnx, feeds), atol=1e-3, rtol=0)


def test_parser_errors_name_the_spec_and_quote_tensorrt(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["sample"], ["out"], domain="com.example")], "unsupported",
        [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [2, 4, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4, 8, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    path = tmp_path / "unsupported.onnx"
    onnx.save(model, str(path))
    spec = tiny_spec("fp32")
    with pytest.raises(BuildError, match=r"could not parse") as raised:
        build(tmp_path, path, spec, STATIC)
    assert spec.name in str(raised.value) and "NoSuchOp" in str(raised.value)
    assert not engine_path(tmp_path, spec).exists()
