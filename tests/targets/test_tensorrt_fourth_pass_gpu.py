"""#45 on a real GPU: what only TensorRT and CUDA can show of the fourth pass's fixes.

Marked `gpu` and `tensorrt` (collected by `make test-gpu`, left out of the default run); without TensorRT, cuda-python
or a CUDA device every test fails with the reason. Device N != 0 needs two GPUs and is skipped, with the reason,
on a one-GPU host.

NEVER RUN YET: no machine here has TensorRT (docs/tensorrt-runtime.md lists these as not run). Each test says what it
proves:
- a stripped plan refitted with a LoRA and saved reloads as the refitted engine (item 1: EXCLUDE_WEIGHTS cleared);
- a restore to base with runs still queued on the runner's stream gives the base engine's outputs (item 2);
- each optimization profile's context under ON_PROFILE_CHANGE (Triton's strategy as `package` sets it) runs, and the
  manifest's per-profile sizes are TensorRT's (item 3);
- a plan of 1 GiB and more streams in (IStreamReaderV2, with TensorRT's own read and seek order) and equals the plan
  loaded from memory (item 6);
- a weight-streaming engine run at a budget equals it run with every weight resident (item 8);
- a runner on GPU 1 allocates and runs there (device N != 0);
- LoRA per request: a device-resident set swap equals the same weights refitted from the host (item 12).
"""

from __future__ import annotations

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


from trt_diffusion.engines_file.engine_spec import Bucket, EngineSpec, Size  # noqa: E402
from trt_diffusion.onnx_facts import read_base_weights  # noqa: E402
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, engine_path, manifest_path  # noqa: E402
from trt_diffusion.targets.tensorrt.runner import EngineGroup, TensorRTRunner  # noqa: E402

STATIC = {"sample": ((2, 8),) * 3}
PROFILES = [{"sample": ((1, 8),) * 3}, {"sample": ((2, 8), (4, 8), (8, 8))}, {"sample": ((16, 8),) * 3}]


def mlp_onnx(path: Path, hidden: int = 64, seed: int = 0) -> Path:
    """sample (batch, 8) -> MatMul(8 x hidden) + bias -> Relu -> MatMul(hidden x 8): weights every test refits."""
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array(rng.standard_normal((8, hidden)).astype(np.float32) * 0.1, "w1"),
               numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32) * 0.1, "b1"),
               numpy_helper.from_array(rng.standard_normal((hidden, 8)).astype(np.float32) * 0.1, "w2")]
    nodes = [helper.make_node("MatMul", ["sample", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["out"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("sample", TensorProto.FLOAT, ["b", 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 8])], initializer=weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=hidden * 8 * 4 > (1 << 30), location=path.name + ".data")
    return path


def spec(model: str, *, refittable=False, options=()) -> EngineSpec:
    return EngineSpec(model=model, family="sd15", source="tests/tiny", component="unet", target="tensorrt",
                      precision="fp32", batch=2, bucket=Bucket.static(Size(64, 64)), refittable=refittable,
                      build_options=(("tensorrt_tf32", False), *options))


def build(workspace: Path, onnx_path: Path, the_spec: EngineSpec, profile=STATIC, extra=()):
    target.check_can_build(the_spec)
    plan = engine_path(workspace, the_spec)
    return plan, target.build_engine(onnx_path, the_spec, profile, plan, workspace / "timing-cache",
                                     extra_profiles=tuple(extra))


def feeds(batch=2, seed=0):
    return {"sample": np.random.default_rng(seed).standard_normal((batch, 8)).astype(np.float32)}


def reference(onnx_path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    w = read_base_weights(onnx_path)
    return np.maximum(inputs["sample"] @ w["w1"] + w["b1"], 0) @ w["w2"]


def lora(base: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (w + 0.2 * rng.standard_normal(w.shape)).astype(np.float32) for n, w in base.items()}


def test_a_stripped_plan_refitted_with_a_lora_reloads_as_the_refitted_engine(tmp_path):
    from trt_diffusion.targets.tensorrt.target import save_refitted_plan

    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    plan, manifest = build(tmp_path, onnx_path, spec("stripped", refittable=True,
                                                     options=(("tensorrt_strip_plan", True),)))
    assert manifest.stripped and manifest.weights_bytes is not None
    loaded = target.load_engine(plan, weights_onnx=onnx_path)
    weights = lora(read_base_weights(onnx_path), seed=1)
    target.refit_from_base(loaded, onnx_path, weights)
    expected = target.run_engine(loaded, feeds())["out"]
    save_refitted_plan(plan, loaded.manifest, target.serialize_refitted(loaded, with_weights=True), weights)
    reloaded = target.load_engine(plan, weights_onnx=onnx_path)  # as a packaged python-backend model loads it
    np.testing.assert_array_equal(target.run_engine(reloaded, feeds())["out"], expected)


def test_a_restore_to_base_with_runs_still_queued_gives_the_base_outputs(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"torch has no CUDA here (build: CUDA {torch.version.cuda or 'none'})")
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    plan, _ = build(tmp_path, onnx_path, spec("queued", refittable=True))
    base = read_base_weights(onnx_path)
    with TensorRTRunner(plan, group=EngineGroup()) as runner:
        expected = runner.run(feeds())["out"]
        runner.refit(lora(base, seed=2), base_weights=base)
        device = torch.from_numpy(feeds()["sample"]).cuda()
        for _ in range(50):  # queued on the runner's stream, nothing synchronized
            runner.run({"sample": device})
        runner.refit(None, base_weights=base)  # refit_to_base: queued after them, never synchronous over them
        np.testing.assert_array_equal(runner.run(feeds())["out"], expected)


def test_each_profile_runs_in_its_own_context_under_on_profile_change(tmp_path):
    import tensorrt as trt

    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    plan, manifest = build(tmp_path, onnx_path, spec("profiles"), PROFILES[0], PROFILES[1:])
    engine = target.load_engine(plan).engine
    assert manifest.profile_device_memory_bytes == tuple(
        int(engine.get_device_memory_size_for_profile_v2(i)) for i in range(len(PROFILES)))
    contexts = [engine.create_execution_context(trt.ExecutionContextAllocationStrategy.ON_PROFILE_CHANGE)
                for _ in PROFILES]  # as Triton's TensorRT backend makes them, one per listed profile
    assert all(context is not None for context in contexts)
    with TensorRTRunner(plan, group=EngineGroup()) as runner:
        for batch in (1, 4, 16, 2):  # one per profile, switching between them
            np.testing.assert_allclose(runner.run(feeds(batch))["out"], reference(onnx_path, feeds(batch)), atol=1e-4)


def test_a_plan_of_a_gibibyte_streams_in_and_equals_the_plan_loaded_from_memory(tmp_path):
    onnx_path = mlp_onnx(tmp_path / "big.onnx", hidden=(1 << 30) // (8 * 4 * 2) + 1024)  # two weights, > 1 GiB
    plan, manifest = build(tmp_path, onnx_path, spec("big"))
    assert manifest.plan_bytes >= 1 << 30
    streamed = target.load_engine(plan, stream=True)
    in_memory = target.load_engine(plan, stream=False)
    np.testing.assert_array_equal(target.run_engine(streamed, feeds())["out"],
                                  target.run_engine(in_memory, feeds())["out"])


def test_a_weight_streaming_engine_at_a_budget_equals_it_fully_resident(tmp_path):
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx", hidden=4096)
    plan, manifest = build(tmp_path, onnx_path, spec("streaming", options=(("tensorrt_weight_streaming", True),)))
    assert manifest.streamable_weights_bytes
    with TensorRTRunner(plan, group=EngineGroup()) as resident:
        expected = resident.run(feeds())["out"]
    with TensorRTRunner(plan, group=EngineGroup(), weight_budget_bytes=0) as streaming:
        assert streaming.engine.engine.weight_streaming_budget_v2 == 0
        np.testing.assert_array_equal(streaming.run(feeds())["out"], expected)


def test_a_runner_on_gpu_1_allocates_and_runs_there(tmp_path):
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("device N != 0 needs two CUDA devices")
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    plan, _ = build(tmp_path, onnx_path, spec("gpu1"))
    with TensorRTRunner(plan, group=EngineGroup(device=1), device=1) as runner:
        before = torch.cuda.mem_get_info(1)[0]
        out = runner.run(feeds())["out"]
        assert torch.cuda.mem_get_info(1)[0] <= before
    np.testing.assert_array_equal(out, target.run_engine(target.load_engine(plan), feeds())["out"])


def test_a_device_resident_lora_swap_equals_the_host_refit(tmp_path):
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    plan, _ = build(tmp_path, onnx_path, spec("resident", refittable=True))
    base = read_base_weights(onnx_path)
    a, b = lora(base, seed=3), lora(base, seed=4)
    host = target.load_engine(plan)
    target.refit_engine(host, a, base)
    expected_a = target.run_engine(host, feeds())["out"]
    with TensorRTRunner(plan, group=EngineGroup()) as runner:
        runner.serve_loras(base, resident_sets=2)
        base_out = runner.run(feeds())["out"]
        from trt_diffusion.targets.tensorrt.refit_weights import weights_digest

        got_a = runner.run_with_set(feeds(), weights_digest(a), a)["out"]
        runner.run_with_set(feeds(), weights_digest(b), b)
        np.testing.assert_array_equal(runner.run_with_set(feeds(), weights_digest(a), a)["out"], got_a)
        np.testing.assert_array_equal(runner.run(feeds())["out"], base_out)
    np.testing.assert_allclose(got_a, expected_a, atol=1e-5, rtol=0)
    assert EngineManifest.read(manifest_path(plan)).refit is None  # nothing written to disk
