"""The TensorRT target on a real GPU: strongly typed builds per precision, refit through the CLI, the
production runner (reuse, CUDA graphs, shared activation memory, torch CUDA tensors), and a Triton
`tensorrt_plan` repository.

Marked `gpu` and `tensorrt`: left out of the default run; `make test-gpu` (its own .venv-gpu with CUDA torch and
`.[tensorrt,test]`) stops with one line when torch has no CUDA or there is no device, runs only the CUDA-only gpu
tests (tests/targets/test_tensorrt_cuda_gpu.py) and then fails when TensorRT is missing, and `-m gpu` on such a
host fails every test here with the reason (a GPU suite that skips itself protects nothing). Capabilities a GPU may lack are skipped with the reason:
bf16 (compute capability 8.0), fp8 (8.9), torch built without CUDA, a tritonserver with the TensorRT backend.
The engines are tiny, so the module runs in a few minutes on a GPU host (the CLI tests export a tiny model).

None of this has run on a GPU yet: no GPU host with TensorRT was available where it was written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = [pytest.mark.gpu, pytest.mark.tensorrt]

from trt_diffusion.targets.tensorrt import engine as target  # noqa: E402
from trt_diffusion.targets.tensorrt.host_check import missing  # noqa: E402


@pytest.fixture(autouse=True)
def _tensorrt_and_a_gpu():
    problems = missing()
    if problems:
        pytest.fail(f"the gpu suite needs TensorRT, cuda-python and a CUDA device: {'; '.join(problems)}", pytrace=False)


import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size  # noqa: E402
from trt_diffusion.errors import BuildError, RefitError, RuntimeInputError  # noqa: E402
from trt_diffusion.onnx_facts import read_base_weights  # noqa: E402
from trt_diffusion.targets.tensorrt.manifest import REBUILD_COMMAND, EngineManifest, engine_path, manifest_path  # noqa: E402
from trt_diffusion.targets.tensorrt.runner import EngineGroup, TensorRTRunner  # noqa: E402

STATIC = {"sample": ((2, 4, 8, 8),) * 3}
RANGE = {"sample": ((1, 4, 8, 8), (2, 4, 16, 16), (4, 4, 32, 32))}
REPO = Path(__file__).resolve().parents[2]


class TinyConvMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.silu(self.conv(sample))
        tokens = hidden.flatten(2).transpose(1, 2)  # (batch, height*width, 8)
        return self.proj(tokens)  # exported as MatMul with a transposed, renamed weight


class CastIO(torch.nn.Module):
    """fp32 in and out around a module held in `dtype`: how the project exports fp16/bf16 graphs."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module.to(dtype), dtype

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.module(sample.to(self.dtype)).float()


def _export(module: torch.nn.Module, path: Path) -> Path:
    with torch.no_grad():
        torch.onnx.export(
            module.eval(), (torch.randn(2, 4, 8, 8),), str(path),
            input_names=["sample"], output_names=["out"],
            dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"}, "out": {0: "batch", 1: "tokens"}},
            opset_version=17, dynamo=False,
        )
    return path


def _tiny_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyConvMatmul().eval()


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory) -> Path:
    return _export(_tiny_module(), tmp_path_factory.mktemp("onnx") / "tiny.onnx")


@pytest.fixture(scope="module")
def fp16_onnx(tmp_path_factory) -> Path:
    return _export(CastIO(_tiny_module(), torch.float16), tmp_path_factory.mktemp("onnx") / "tiny_fp16.onnx")


@pytest.fixture(scope="module")
def bf16_onnx(tmp_path_factory) -> Path:
    return _export(CastIO(_tiny_module(), torch.bfloat16), tmp_path_factory.mktemp("onnx") / "tiny_bf16.onnx")


def _conv_weight() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((8, 4, 3, 3)).astype(np.float32) * 0.2


def qdq_over_fp16(path: Path, quantized: int) -> Path:
    """fp32 in -> fp16 -> Q/DQ (int8 or fp8 E4M3) on activations and weights -> fp16 Conv -> fp32 out: the
    graph ModelOpt gives for fp8/int8 TensorRT engines (Q/DQ over the fp16 model)."""
    zero = (helper.make_tensor("zp", TensorProto.INT8, [], [0]) if quantized == TensorProto.INT8
            else helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0.0]))
    initializers = [
        numpy_helper.from_array(np.array(0.05 if quantized == TensorProto.INT8 else 0.01, np.float16), "x.scale"),
        numpy_helper.from_array(_conv_weight().astype(np.float16), "conv.weight"),
        numpy_helper.from_array(np.array(0.005 if quantized == TensorProto.INT8 else 0.002, np.float16), "w.scale"),
        zero,
    ]
    nodes = [
        helper.make_node("Cast", ["sample"], ["x16"], to=TensorProto.FLOAT16),
        helper.make_node("QuantizeLinear", ["x16", "x.scale", "zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x.scale", "zp"], ["x_dq"]),
        helper.make_node("QuantizeLinear", ["conv.weight", "w.scale", "zp"], ["w_q"]),
        helper.make_node("DequantizeLinear", ["w_q", "w.scale", "zp"], ["w_dq"]),
        helper.make_node("Conv", ["x_dq", "w_dq"], ["y16"], pads=[1, 1, 1, 1]),
        helper.make_node("Cast", ["y16"], ["out"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "tiny_qdq_fp16",
        [helper.make_tensor_value_info("sample", TensorProto.FLOAT, [2, 4, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8, 8, 8])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def conv_reference(feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The unquantized fp32 conv the Q/DQ graphs approximate."""
    sample = torch.from_numpy(feeds["sample"])
    return torch.nn.functional.conv2d(sample, torch.from_numpy(_conv_weight()), padding=1).numpy()


def tiny_spec(precision: str, refittable: bool = False, *, model: str = "tiny") -> EngineSpec:
    return EngineSpec(
        model=model, family="sd15", source="tests/tiny", component="unet", target="tensorrt",
        precision=precision, batch=2, bucket=Bucket.static(Size(64, 64)), refittable=refittable,
        # TF32 off: fp32 engines are compared with ONNX Runtime to 1e-4
        build_options=(("tensorrt_optimization_level", 3), ("tensorrt_tf32", False), ("tensorrt_workspace_gb", 1)),
    )


def build(workspace: Path, onnx_path: Path, spec: EngineSpec, profile: dict) -> tuple[Path, EngineManifest]:
    target.check_can_build(spec)
    plan = engine_path(workspace, spec)
    manifest = target.build_engine(onnx_path, spec, profile, plan, workspace / "timing-cache")
    return plan, manifest


def needs_compute_capability(major: int, minor: int, precision: str) -> None:
    _, capability, name = target.host_info()
    if tuple(capability) < (major, minor):
        pytest.skip(f"{precision} needs compute capability {major}.{minor}; {name} has {capability[0]}.{capability[1]}")


def onnxruntime_out(onnx_path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return session.run(["out"], feeds)[0]


def sample(shape, seed: int = 0) -> dict[str, np.ndarray]:
    return {"sample": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def relative_rms(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - expected) ** 2)) / np.sqrt(np.mean(expected ** 2)))


# ---------------------------------------------------------------------------------------------- builds per precision


def test_fp32_engine_matches_onnxruntime(tiny_onnx, tmp_path):
    import tensorrt as trt

    plan, manifest = build(tmp_path, tiny_onnx, tiny_spec("fp32"), STATIC)
    assert manifest.tensorrt_version == trt.__version__ and manifest.plan_bytes == plan.stat().st_size
    assert [(t.name, t.dtype) for t in manifest.inputs] == [("sample", "float32")]
    feeds = sample((2, 4, 8, 8))
    with TensorRTRunner(plan) as runner:
        np.testing.assert_allclose(runner.run(feeds)["out"], onnxruntime_out(tiny_onnx, feeds), atol=1e-4, rtol=0)


def test_fp16_engine_from_an_fp16_onnx(tiny_onnx, fp16_onnx, tmp_path):
    plan, manifest = build(tmp_path, fp16_onnx, tiny_spec("fp16"), RANGE)
    assert manifest.flags["strongly_typed"] is True and manifest.flags["precision"] == "fp16"
    assert [(t.name, t.dtype) for t in manifest.inputs] == [("sample", "float32")]  # fp32 I/O around fp16
    with TensorRTRunner(plan) as runner:
        for seed, shape in enumerate([(1, 4, 8, 8), (2, 4, 16, 16), (4, 4, 32, 32), (3, 4, 8, 24)]):
            feeds = sample(shape, seed)
            expected = onnxruntime_out(tiny_onnx, feeds)
            got = runner.run(feeds)["out"]
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, atol=2e-2, rtol=0)
        with pytest.raises(RuntimeInputError, match=r"outside the engine's profile \(1, 4, 8, 8\)..\(4, 4, 32, 32\)"):
            runner.run(sample((8, 4, 8, 8)))
    with pytest.raises(BuildError, match="weights are float32"):  # an fp16 engine from an fp32 graph is refused
        build(tmp_path / "refused", tiny_onnx, tiny_spec("fp16"), STATIC)


def test_bf16_engine_from_a_bf16_onnx(tiny_onnx, bf16_onnx, tmp_path):
    needs_compute_capability(8, 0, "bf16")
    plan, manifest = build(tmp_path, bf16_onnx, tiny_spec("bf16"), STATIC)
    assert manifest.flags["precision"] == "bf16"
    feeds = sample((2, 4, 8, 8))
    with TensorRTRunner(plan) as runner:
        got = runner.run(feeds)["out"]
    expected = onnxruntime_out(tiny_onnx, feeds)
    assert relative_rms(got, expected) < 2e-2  # bf16 has 8 bits of mantissa


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_qdq_over_fp16_builds_a_quantized_engine(precision, tmp_path):
    if precision == "fp8":
        needs_compute_capability(8, 9, "fp8")
    quantized = TensorProto.INT8 if precision == "int8" else TensorProto.FLOAT8E4M3FN
    onnx_path = qdq_over_fp16(tmp_path / f"{precision}.onnx", quantized)
    plan, manifest = build(tmp_path, onnx_path, tiny_spec(precision), STATIC)
    assert manifest.flags["strongly_typed"] is True and manifest.flags["precision"] == precision
    feeds = sample((2, 4, 8, 8))
    with TensorRTRunner(plan) as runner:
        got = runner.run(feeds)["out"]
    error = relative_rms(got, conv_reference(feeds))
    assert error < (0.05 if precision == "int8" else 0.1), f"{precision} engine: relative RMS error {error:.3f}"
    assert error > 0, "a quantized engine that equals fp32 exactly did not quantize"


def test_plan_with_mismatched_manifest_is_refused(tiny_onnx, tmp_path):
    plan, manifest = build(tmp_path, tiny_onnx, tiny_spec("fp32"), STATIC)
    target.load_engine(plan)
    manifest.model_copy(update={"tensorrt_version": "9.3.0.1"}).write(manifest_path(plan))
    with pytest.raises(BuildError, match=r"built with TensorRT 9.3.0.1") as raised:
        TensorRTRunner(plan).activate()
    assert REBUILD_COMMAND in str(raised.value)


# ---------------------------------------------------------------------------------------------- refit


def test_refit_to_b_and_back_to_a_in_process(tiny_onnx, tmp_path):
    plan, _ = build(tmp_path, tiny_onnx, tiny_spec("fp32", refittable=True), STATIC)
    engine = target.load_engine(plan)
    base = read_base_weights(tiny_onnx)
    feeds = sample((2, 4, 8, 8))
    outputs_a = target.run_engine(engine, feeds)["out"]
    rng = np.random.default_rng(7)
    weights_b = {n: (w + 0.1 * rng.standard_normal(w.shape)).astype(w.dtype) for n, w in base.items()}
    target.refit_engine(engine, weights_b, base)
    assert np.abs(target.run_engine(engine, feeds)["out"] - outputs_a).max() > 0.1
    target.refit_to_base(engine, base)
    np.testing.assert_array_equal(target.run_engine(engine, feeds)["out"], outputs_a)
    fixed, _ = build(tmp_path / "fixed", tiny_onnx, tiny_spec("fp32", model="fixed"), STATIC)
    with pytest.raises(RefitError, match="not built refittable"):
        target.refit_engine(target.load_engine(fixed), base)


@pytest.fixture(scope="module")
def cli_project(tmp_path_factory) -> Path:
    """A tiny SD1.5 model with a LoRA and an engines.yaml whose refittable UNet is a TensorRT engine, built
    through the CLI."""
    root = tmp_path_factory.mktemp("cli")
    cli(root, "models", "tiny", "--out", "models/tiny", "--lora")
    (root / "engines.yaml").write_text(textwrap.dedent("""\
        version: 1
        build: {workspace: build, opset: 20, jobs: 1}
        defaults: {targets: [tensorrt], cfg: batched, batch: [1]}
        models:
          tiny:
            source: models/tiny
            family: sd15
            components: [text_encoder, unet, vae_decoder]
            buckets: ["64x64"]
            precision: {text_encoder: fp32, unet: fp32, vae_decoder: fp32}
            loras:
              style: {source: models/tiny/lora/pytorch_lora_weights.safetensors, mode: refit, scale: 1.0}
        """))
    cli(root, "build", "engines.yaml", "--target", "tensorrt")
    return root


def cli(root: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "trt_diffusion", *args], cwd=root, capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "TRT_DIFFUSION_PROGRESS": "off"})
    assert done.returncode == 0, f"trt-diffusion {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def unet_outputs(root: Path) -> np.ndarray:
    """The refittable UNet plan, loaded afresh from disk (as a new process would), on fixed feeds."""
    plans = sorted((root / "build").rglob("*unet*.plan"))
    assert len(plans) == 1, plans
    runner = TensorRTRunner(plans[0], group=EngineGroup())
    manifest = runner.manifest
    rng = np.random.default_rng(3)
    feeds = {t.name: rng.standard_normal(manifest.profile_shapes[t.name][0]).astype(np.float32)
             for t in manifest.inputs}
    with runner:
        return runner.run(feeds)["noise_pred"]


def test_refit_a_b_a_through_the_cli_survives_save_and_reload(cli_project):
    lora = "models/tiny/lora/pytorch_lora_weights.safetensors"
    base = unet_outputs(cli_project)
    cli(cli_project, "refit", "engines.yaml", "--model", "tiny", "--target", "tensorrt", "--lora", f"{lora}:1.0")
    outputs_a = unet_outputs(cli_project)
    cli(cli_project, "refit", "engines.yaml", "--model", "tiny", "--target", "tensorrt", "--lora", f"{lora}:0.4")
    outputs_b = unet_outputs(cli_project)
    cli(cli_project, "refit", "engines.yaml", "--model", "tiny", "--target", "tensorrt", "--lora", f"{lora}:1.0")
    assert np.abs(outputs_a - base).max() > 1e-3 and np.abs(outputs_b - outputs_a).max() > 1e-3
    np.testing.assert_array_equal(unet_outputs(cli_project), outputs_a)  # no residue of B


def test_refit_base_through_the_cli_restores_the_built_engine(cli_project):
    lora = "models/tiny/lora/pytorch_lora_weights.safetensors"
    cli(cli_project, "refit", "engines.yaml", "--model", "tiny", "--target", "tensorrt", "--base")
    base = unet_outputs(cli_project)
    cli(cli_project, "refit", "engines.yaml", "--model", "tiny", "--target", "tensorrt", "--lora", f"{lora}:1.0")
    assert np.abs(unet_outputs(cli_project) - base).max() > 1e-3
    cli(cli_project, "refit", "engines.yaml", "--model", "tiny", "--target", "tensorrt", "--base")
    np.testing.assert_array_equal(unet_outputs(cli_project), base)


# ---------------------------------------------------------------------------------------------- the runner


def test_runner_reuses_its_context_and_allocations(tiny_onnx, tmp_path):
    plan, _ = build(tmp_path, tiny_onnx, tiny_spec("fp32"), RANGE)
    runner = TensorRTRunner(plan, group=EngineGroup())
    reference = target.run_engine(target.load_engine(plan), sample((2, 4, 16, 16)))["out"]
    with runner:
        after_activation = (runner.stats.contexts_created, runner.stats.device_allocations,
                            runner.stats.host_allocations, runner.group.stats["activation_allocations"])
        free_before, _ = runner.group.cuda.mem_get_info()
        for seed in range(20):
            shape = [(2, 4, 16, 16), (1, 4, 8, 8), (4, 4, 32, 32)][seed % 3]
            runner.run(sample(shape, seed))
        free_after, _ = runner.group.cuda.mem_get_info()
        np.testing.assert_allclose(runner.run(sample((2, 4, 16, 16)))["out"], reference, atol=1e-4, rtol=0)
        assert (runner.stats.contexts_created, runner.stats.device_allocations, runner.stats.host_allocations,
                runner.group.stats["activation_allocations"]) == after_activation == (1, 2, 2, 1)
        assert abs(free_before - free_after) < (16 << 20), "device memory grew while running"
    assert not runner.active and runner.group.activation_bytes == 0


def test_cuda_graph_replay_equals_eager(tiny_onnx, tmp_path):
    plan, _ = build(tmp_path, tiny_onnx, tiny_spec("fp32"), STATIC)
    group = EngineGroup()
    with TensorRTRunner(plan, group=group, cuda_graph=True) as graph, TensorRTRunner(plan, name="eager", group=group) as eager:
        for seed in range(5):
            feeds = sample((2, 4, 8, 8), seed)
            np.testing.assert_array_equal(graph.run(feeds)["out"], eager.run(feeds)["out"])
    assert (graph.stats.eager_runs, graph.stats.graph_captures, graph.stats.graph_launches) == (1, 1, 4)
    assert eager.stats.graph_captures == 0


def test_engines_of_a_group_share_activation_memory(tiny_onnx, fp16_onnx, tmp_path):
    small, _ = build(tmp_path, tiny_onnx, tiny_spec("fp32"), STATIC)
    large, _ = build(tmp_path, fp16_onnx, tiny_spec("fp16", model="large"), RANGE)
    group = EngineGroup()
    with TensorRTRunner(small, group=group) as a, TensorRTRunner(large, group=group) as b:
        needs = [int(r.engine.engine.device_memory_size_v2) for r in (a, b)]
        assert group.activation_bytes == max(-(-n // 256) * 256 for n in needs)
        assert group.stats["activation_allocations"] <= 2  # once, or grown once when the larger joined
        free_before, _ = group.cuda.mem_get_info()
        for seed in range(3):  # alternate: both run in the one allocation
            a.run(sample((2, 4, 8, 8), seed))
            b.run(sample((4, 4, 32, 32), seed))
        assert group.cuda.mem_get_info()[0] == pytest.approx(free_before, abs=16 << 20)


def test_torch_cuda_tensors_in_and_out_without_host_copies(tiny_onnx, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip(f"torch has no CUDA here (build: CUDA {torch.version.cuda or 'none'})")
    plan, _ = build(tmp_path, tiny_onnx, tiny_spec("fp32"), STATIC)
    feeds = sample((2, 4, 8, 8))
    with TensorRTRunner(plan, group=EngineGroup()) as runner:
        on_device = runner.run({"sample": torch.from_numpy(feeds["sample"]).cuda()})["out"]
        assert isinstance(on_device, torch.Tensor) and on_device.is_cuda
        np.testing.assert_array_equal(on_device.cpu().numpy(), runner.run(feeds)["out"])


# ---------------------------------------------------------------------------------------------- Triton


def test_triton_tensorrt_plan_repository_is_served(tiny_onnx, tmp_path):
    server = shutil.which("tritonserver")
    backends = Path(os.environ.get("TRITON_BACKENDS", "/opt/tritonserver/backends"))
    if server is None or not (backends / "tensorrt").is_dir():
        pytest.skip("no tritonserver with the TensorRT backend here (NVIDIA's Triton containers have one; "
                    "set TRITON_BACKENDS to its backends folder)")
    from trt_diffusion.targets import get_target
    from trt_diffusion.targets.base import BuiltEngine

    plan, manifest = build(tmp_path / "ws", tiny_onnx, tiny_spec("fp32"), STATIC)
    model = get_target("tensorrt").triton_model(BuiltEngine(tiny_spec("fp32"), plan, manifest), engine_backend="native")
    assert model.backend == "tensorrt_plan"
    version = tmp_path / "repo" / "tiny_unet" / "1"
    version.mkdir(parents=True)
    for name, source in model.files.items():
        shutil.copy(source, version / name)
    (version.parent / "config.pbtxt").write_text(textwrap.dedent("""\
        name: "tiny_unet"
        platform: "tensorrt_plan"
        max_batch_size: 0
        input [{ name: "sample", data_type: TYPE_FP32, dims: [2, 4, 8, 8] }]
        output [{ name: "out", data_type: TYPE_FP32, dims: [2, 64, 16] }]
        instance_group [{ kind: KIND_GPU, count: 1 }]
        """))
    from trt_diffusion.triton.server import free_port

    http = free_port()
    process = subprocess.Popen([server, f"--model-repository={tmp_path / 'repo'}", f"--backend-directory={backends}",
                                f"--http-port={http}", f"--grpc-port={free_port()}", f"--metrics-port={free_port()}",
                                "--http-address=127.0.0.1", "--grpc-address=127.0.0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        for _ in range(120):
            try:
                if client.is_model_ready("tiny_unet"):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            import time

            time.sleep(0.5)
        else:
            pytest.fail("tritonserver did not load the tensorrt_plan model:\n" + process.stdout.read1().decode())
        feeds = sample((2, 4, 8, 8))
        request = httpclient.InferInput("sample", [2, 4, 8, 8], "FP32")
        request.set_data_from_numpy(feeds["sample"])
        got = client.infer("tiny_unet", [request]).as_numpy("out")
        np.testing.assert_allclose(got, onnxruntime_out(tiny_onnx, feeds), atol=1e-4, rtol=0)
    finally:
        process.terminate()
        process.wait(timeout=30)



# ---------------------------------------------------------------------------------------------- #27 item 8


def with_options(spec: EngineSpec, **options) -> EngineSpec:
    import dataclasses

    return dataclasses.replace(spec, build_options=tuple(sorted({**dict(spec.build_options), **options}.items())))


def refit_waived(spec: EngineSpec) -> EngineSpec:
    """On a TensorRT release with a known refit defect the build refuses refittable specs; these tests are the
    evidence that decides whether it may leave the list, so they build under the waiver there."""
    import tensorrt as trt

    from trt_diffusion.targets.tensorrt.host_gates import REFIT_KNOWN_ISSUES
    from trt_diffusion.targets.tensorrt.versions import parse_trt_version

    known = parse_trt_version(trt.__version__)[:2] in REFIT_KNOWN_ISSUES
    return with_options(spec, tensorrt_allow_refit_on_11_3=True) if known else spec


def test_a_refittable_fp16_engine_equals_onnxruntime(tiny_onnx, fp16_onnx, tmp_path):
    """TensorRT 11.3 can drop a GEMM bias in REFIT engines (the Linear here has one): a refittable fp16 engine
    must equal ONNX Runtime on the same fp16 graph, and the non-refittable one, before 11.3 leaves
    config.REFIT_KNOWN_ISSUES."""
    refittable, _ = build(tmp_path, fp16_onnx, refit_waived(tiny_spec("fp16", refittable=True)), STATIC)
    fixed, _ = build(tmp_path / "fixed", fp16_onnx, tiny_spec("fp16", model="fixed"), STATIC)
    feeds = sample((2, 4, 8, 8))
    expected = onnxruntime_out(fp16_onnx, feeds)
    with TensorRTRunner(refittable, group=EngineGroup()) as a, TensorRTRunner(fixed, group=EngineGroup()) as b:
        got, reference = a.run(feeds)["out"], b.run(feeds)["out"]
    np.testing.assert_allclose(got, expected, atol=2e-2, rtol=0)
    np.testing.assert_allclose(got, reference, atol=1e-2, rtol=0)
    assert relative_rms(got, expected) < 5e-3, "a bias dropped? (TensorRT 11.3 known issue)"


def test_a_version_compatible_plan_loads_and_runs(tiny_onnx, tmp_path):
    """Built with VERSION_COMPATIBLE, loaded with its host code allowed (the spec asks, the plan's sha256
    matches), through the target's runner as the pipeline loads it."""
    from trt_diffusion.targets import get_target
    from trt_diffusion.targets.base import BuiltEngine

    spec = with_options(tiny_spec("fp32", model="vc"), tensorrt_version_compatible=True)
    plan, manifest = build(tmp_path, tiny_onnx, spec, STATIC)
    assert manifest.flags["version_compatible"] is True and manifest.plan_sha256
    feeds = sample((2, 4, 8, 8))
    expected = onnxruntime_out(tiny_onnx, feeds)
    np.testing.assert_allclose(target.run_engine(target.load_engine(plan, spec=spec), feeds)["out"], expected,
                               atol=1e-4, rtol=0)
    with get_target("tensorrt").runner(BuiltEngine(spec, plan, manifest)) as runner:
        np.testing.assert_allclose(runner.run(feeds)["out"], expected, atol=1e-4, rtol=0)
    data = bytearray(plan.read_bytes())
    data[len(data) // 2] ^= 0xFF
    plan.write_bytes(bytes(data))
    with pytest.raises(BuildError, match="sha256"):
        target.load_engine(plan, spec=spec)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_refit_of_fp16_and_bf16_engines_from_base(precision, fp16_onnx, bf16_onnx, tmp_path):
    if precision == "bf16":
        needs_compute_capability(8, 0, "bf16")
    onnx_path = fp16_onnx if precision == "fp16" else bf16_onnx
    plan, _ = build(tmp_path, onnx_path, refit_waived(tiny_spec(precision, refittable=True)), STATIC)
    engine = target.load_engine(plan)
    feeds = sample((2, 4, 8, 8))
    built = target.run_engine(engine, feeds)["out"]
    base = read_base_weights(onnx_path)
    rng = np.random.default_rng(5)
    lora = {n: (w.astype(np.float32) + 0.1 * rng.standard_normal(w.shape)).astype(w.dtype) for n, w in base.items()}
    target.refit_from_base(engine, onnx_path, lora)
    assert np.abs(target.run_engine(engine, feeds)["out"] - built).max() > 1e-2
    target.refit_from_base(engine, onnx_path)  # back to base: nothing of the LoRA left
    np.testing.assert_array_equal(target.run_engine(engine, feeds)["out"], built)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_refit_changes_the_weights_and_restores_the_built_engine(precision, tmp_path):
    if precision == "fp8":
        needs_compute_capability(8, 9, "fp8")
    quantized = TensorProto.INT8 if precision == "int8" else TensorProto.FLOAT8E4M3FN
    onnx_path = qdq_over_fp16(tmp_path / f"{precision}.onnx", quantized)
    plan, _ = build(tmp_path, onnx_path, refit_waived(tiny_spec(precision, refittable=True)), STATIC)
    engine = target.load_engine(plan)
    feeds = sample((2, 4, 8, 8))
    built = target.run_engine(engine, feeds)["out"]
    weight = read_base_weights(onnx_path, ["conv.weight"])["conv.weight"]
    target.refit_quantized_from_base(engine, onnx_path, {"conv.weight": (weight * 1.5).astype(weight.dtype)})
    assert np.abs(target.run_engine(engine, feeds)["out"] - built).max() > 1e-2
    target.refit_quantized_from_base(engine, onnx_path, {})
    np.testing.assert_array_equal(target.run_engine(engine, feeds)["out"], built)


@pytest.fixture(scope="module")
def sdxl_project(tmp_path_factory) -> Path:
    """A tiny SDXL model built as TensorRT engines through the CLI (static 64x64, batch 1, CFG batched)."""
    root = tmp_path_factory.mktemp("sdxl")
    cli(root, "models", "tiny", "--family", "sdxl", "--out", "models/tiny-sdxl")
    (root / "engines.yaml").write_text(textwrap.dedent("""\
        version: 1
        build: {workspace: build, opset: 20, jobs: 1}
        defaults: {targets: [tensorrt], cfg: batched, batch: [1]}
        models:
          tiny:
            source: models/tiny-sdxl
            family: sdxl
            buckets: ["64x64"]
            precision: fp32
        """))
    cli(root, "build", "engines.yaml", "--target", "tensorrt")
    return root


def test_the_device_latent_path_equals_the_host_path_tiny_sdxl(sdxl_project, monkeypatch):
    """Latents on the GPU between steps (torch CUDA tensors through the runner, CUDA graphs on) give the image the
    host path (numpy between runner and scheduler) gives."""
    if not torch.cuda.is_available():
        pytest.fail(f"torch has no CUDA here (build: CUDA {torch.version.cuda or 'none'})", pytrace=False)
    from trt_diffusion.engines_file import load_engines_file
    from trt_diffusion.runtime.loader import engine_runners
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
    from trt_diffusion.targets.tensorrt.runner import CUDA_GRAPH_ENV

    monkeypatch.setenv(CUDA_GRAPH_ENV, "1")
    config = load_engines_file(sdxl_project / "engines.yaml")
    model_dir, family, table = engine_runners(config, "tiny", "tensorrt")
    pipeline = EnginePipeline(model_dir, family, table)
    request = GenerationRequest(prompt="a lighthouse at dusk", height=64, width=64, steps=4, seed=3)
    assert pipeline._latent_device(request) == "cuda"
    on_device = pipeline.generate(request).images[0]
    denoisers = [e.runner for e in table.entries if e.component == "unet"]
    assert any(r.stats.graph_launches for r in denoisers), "CUDA graphs were not replayed on the device path"
    monkeypatch.setattr(EnginePipeline, "_latent_device", lambda self, request: None)
    on_host = pipeline.generate(request).images[0]
    assert np.abs(on_device.astype(np.int16) - on_host.astype(np.int16)).max() <= 2
