"""The TensorRT runner's bookkeeping, on CPU.

NO REAL PART OF TENSORRT OR CUDA RUNS IN THIS FILE: neither can be installed or run on these machines.
The runner is driven through a stand-in generated from the `tensorrt-stubs` .pyi (tests/shared/
tensorrt_stub_fake.py: every class and member taken from TensorRT's real Python API, unknown names refused)
over a fake CUDA runtime with cuda-python's call names. What this proves: contexts and buffers are made
once, reused and freed; the engines of one group share one activation allocation sized to the largest;
CUDA graphs are captured only for static shapes and replayed; the GPU memory bound unloads the least
recently used engine; wrong feeds fail before anything loads. What it cannot prove (the gpu suite,
tests/targets/test_tensorrt_gpu.py, does on a GPU host): that TensorRT and CUDA behave as the fake does.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trt_diffusion.errors import RuntimeInputError
from trt_diffusion.targets.tensorrt import device_memory as dm
from trt_diffusion.targets.tensorrt import host_probe, trt_log
from trt_diffusion.targets.tensorrt import refit as trt_refit
from trt_diffusion.targets.tensorrt.cudart import Cuda
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, manifest_path
from trt_diffusion.tensors import TensorSpec

fake = pytest.importorskip("tensorrt_stub_fake")
if fake.stub_path() is None:
    pytest.skip(f"tensorrt-stubs are not installed (pip install --no-deps {fake.STUB_PACKAGE})", allow_module_level=True)

from trt_diffusion.targets.tensorrt.runner import EngineGroup, TensorRTRunner  # noqa: E402
from trt_diffusion.targets.tensorrt.runner import _device_empty as REAL_DEVICE_EMPTY  # noqa: E402

STATIC = {"sample": ((2, 4, 8, 8),) * 3}
DYNAMIC = {"sample": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 16, 16))}


# ---------------------------------------------------------------------------------------------- pure decisions


def test_sizes_are_aligned_and_exact():
    assert dm.align_up(0) == 0 and dm.align_up(1) == 256 and dm.align_up(256) == 256 and dm.align_up(257) == 512
    assert dm.tensor_bytes((2, 4, 64, 64), "float16") == 65536
    assert dm.tensor_bytes((3, 5), "float32") == 60
    assert dm.tensor_bytes((3,), "int4") == 2  # packed nibbles, rounded up
    tensors = [dm.IOTensor("sample", True, "float32", (2, 4, 8, 8)), dm.IOTensor("out", False, "float16", (3, 5))]
    assert dm.buffer_sizes(tensors) == {"sample": 2048, "out": 256}
    with pytest.raises(ValueError, match="unknown dimension"):
        dm.tensor_bytes((-1, 4), "float32")


def test_shared_activation_is_the_largest_need():
    assert dm.shared_activation_bytes({"unet": 3_000_000_000, "vae": 5_000_000_001, "clip": 10}) == 5_000_000_256
    assert dm.shared_activation_bytes({}) == 0


def test_graph_capture_only_for_static_profiles():
    assert dm.is_static_profile(STATIC) and not dm.is_static_profile(DYNAMIC)
    assert dm.graph_capture_reason(True, STATIC) is None
    assert "dynamic-shape" in dm.graph_capture_reason(True, DYNAMIC)
    assert "not requested" in dm.graph_capture_reason(False, STATIC)
    key = dm.GraphKey.of({"sample": (2, 4, 8, 8)}, 1, 1)
    assert dm.graph_is_valid(key, dm.GraphKey.of({"sample": (2, 4, 8, 8)}, 1, 1))
    assert not dm.graph_is_valid(key, dm.GraphKey.of({"sample": (2, 4, 8, 8)}, 2, 1))  # activation reallocated
    assert not dm.graph_is_valid(key, dm.GraphKey.of({"sample": (2, 4, 8, 8)}, 1, 2))  # a buffer reallocated
    assert not dm.graph_is_valid(None, key)


def test_memory_bound_from_env_or_device():
    assert dm.memory_bound_bytes(80 << 30) == int((80 << 30) * 0.9)
    assert dm.memory_bound_bytes(80 << 30, "12.5") == int(12.5 * (1 << 30))
    with pytest.raises(dm.MemoryBudgetError, match=dm.MEMORY_ENV):
        dm.memory_bound_bytes(80 << 30, "lots")
    with pytest.raises(dm.MemoryBudgetError, match="positive"):
        dm.memory_bound_bytes(80 << 30, "0")


def test_budget_evicts_least_recently_used_and_never_pinned():
    budget = dm.EngineBudget(100)
    assert budget.admit("a", 40) == [] and budget.admit("b", 40) == []
    budget.touch("a")  # b is now least recently used
    assert budget.admit("c", 40) == ["b"]
    assert budget.loaded == ["a", "c"]
    budget.pin("a")
    assert budget.admit("d", 50) == ["c"]  # a is pinned: c goes instead
    with pytest.raises(dm.MemoryBudgetError, match=r"engine e needs .* a \(0.00 GiB\)"):
        budget.admit("e", 90)
    budget.unpin("a")
    budget.set_shared(10)
    assert budget.admit("e", 90) == ["a", "d"]
    assert budget.used_bytes == 100
    with pytest.raises(dm.MemoryBudgetError):
        dm.EngineBudget(10).admit("huge", 11)


def test_budget_grows_for_resident_refit_weights_and_lora_sets_leave_least_recently_used_first():
    budget = dm.EngineBudget(100)
    budget.admit("unet", 40)
    budget.admit("vae", 40)
    assert budget.grow("unet", 30) == ["vae"]  # the unet's resident LoRA weights push the vae out, never itself
    assert budget.used_bytes == 70
    budget.pin("unet")
    with pytest.raises(dm.MemoryBudgetError, match="resident_lora_sets"):
        budget.grow("unet", 40)
    assert budget.grow("unet", -30) == [] and budget.used_bytes == 40
    assert budget.grow("gone", -10) == []  # an engine already unloaded frees nothing twice
    sets = dm.ResidentSets(2)
    assert sets.add("a", 10) == [] and sets.add("b", 10) == []
    sets.use("a")
    assert sets.add("c", 10) == ["b"] and sets.digests == ["a", "c"] and sets.total_bytes == 20
    assert sets.clear() == ["a", "c"] and "a" not in sets


def test_feeds_are_described_without_torch_cuda():
    import torch

    info = dm.describe_feed(np.zeros((2, 3), np.float16))
    assert (info.dtype, info.shape, info.on_device) == ("float16", (2, 3), False)
    info = dm.describe_feed(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert (info.dtype, info.shape, info.on_device) == ("bfloat16", (2, 3), False)
    assert not dm.outputs_on_device({"x": torch.zeros(1), "y": np.zeros(1)})


# ---------------------------------------------------------------------------------------------- the stand-in


def test_fake_is_generated_from_the_stubs_and_refuses_other_names():
    trt = fake.FakeTensorRT()
    assert {"ICudaEngine", "IExecutionContext", "Refitter", "Runtime"} <= set(trt.classes)
    assert trt.ExecutionContextAllocationStrategy.USER_MANAGED.name == "USER_MANAGED"
    context_cls = trt.classes["IExecutionContext"]
    assert {"execute_async_v3", "set_device_memory", "set_tensor_address", "set_input_shape"} <= set(context_cls.members)
    engine = trt.engine(_description(STATIC), fake.FakeCudart())
    context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
    with pytest.raises(AttributeError, match="not in the TensorRT stubs"):
        context.set_device_memry(0, 0)  # a misspelling fails as it would on TensorRT
    with pytest.raises(AttributeError, match="not in the TensorRT stubs"):
        engine.get_binding_shape(0)  # removed in TensorRT 10
    with pytest.raises(NotImplementedError, match="infer_shapes"):
        context.infer_shapes()
    with pytest.raises(TypeError, match="stream_handle"):
        context.execute_async_v3(object())  # TensorRT takes an int handle, not a stream object
    with pytest.raises(fake.StubMismatch, match="does not match the stub"):
        fake.make_class(context_cls, {"set_device_memory": lambda self, pointer, size: None})
    with pytest.raises(fake.StubMismatch, match="no member"):
        fake.make_class(context_cls, {"set_device_memry": lambda self, memory, size: None})


# ---------------------------------------------------------------------------------------------- the runner


def _description(profile, activation_bytes=1 << 20):
    (low, opt, high), = profile.values()
    return fake.EngineDescription(
        inputs={"sample": ("FLOAT", low, opt, high)}, outputs={"out": "FLOAT"},
        output_shape=lambda shapes: {"out": shapes.get("sample", high)},
        compute=lambda feeds: {"out": feeds["sample"] * 2 + 1}, activation_bytes=activation_bytes)


def _plan(tmp_path: Path, name: str, profile, plan_bytes: int = 1000, device_memory_bytes: int | None = None,
          output_dtype: str = "float32", profiles=None, **manifest_fields) -> Path:
    plan = tmp_path / f"{name}.plan"
    plan.write_bytes(b"\0" * plan_bytes)
    shape = tuple(d if lo == hi else -1 for d, lo, hi in zip(profile["sample"][2], *profile["sample"][::2]))
    EngineManifest(
        spec_key=name, spec_name=name, tensorrt_version="10.13.0.35", compute_capability=(8, 9), device_name="fake",
        profile_shapes=profile, onnx_sha256="0" * 64, plan_bytes=plan_bytes, build_seconds=0.0,
        plan_sha256=hashlib.sha256(plan.read_bytes()).hexdigest(), device_memory_bytes=device_memory_bytes,
        profiles=tuple(profiles) if profiles else None, **{"flags": {}, **manifest_fields},
        inputs=(TensorSpec(name="sample", dtype="float32", shape=shape),),
        outputs=(TensorSpec(name="out", dtype=output_dtype, shape=shape),),
    ).write(manifest_path(plan))
    return plan


class Rig:
    """One fake GPU: the stub-generated TensorRT, the fake CUDA runtime, a group, runners over fake plans."""

    def __init__(self, tmp_path: Path, bound_bytes: int = 1 << 30, cudart=None):
        self.tmp_path = tmp_path
        self.trt = fake.FakeTensorRT()
        self.cudart = cudart if cudart is not None else fake.FakeCudart()
        self.group = EngineGroup(cuda=Cuda(self.cudart), bound_bytes=bound_bytes)
        self.loads: list[str] = []

    def runner(self, name, profile=STATIC, *, activation_bytes=1 << 20, plan_bytes=1000, cuda_graph=False,
               device_memory_bytes=None, description=None, output_dtype="float32", profiles=None, runner_options=None,
               **manifest_fields):
        plan = _plan(self.tmp_path, name, profile, plan_bytes, device_memory_bytes, output_dtype, profiles,
                     **manifest_fields)
        description = description or _description(profile, activation_bytes)

        def load(path):
            self.loads.append(name)
            return SimpleNamespace(engine=self.trt.engine(description, self.cudart),
                                   manifest=EngineManifest.read(manifest_path(path)))

        return TensorRTRunner(plan, name=name, group=self.group, cuda_graph=cuda_graph, loader=load, trt_module=self.trt,
                              **(runner_options or {}))


def _sample(shape=(2, 4, 8, 8), seed=0):
    return {"sample": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def test_creating_a_runner_loads_and_allocates_nothing(tmp_path):
    rig = Rig(tmp_path)
    runner = rig.runner("unet")
    assert rig.loads == [] and sum(rig.cudart.calls.values()) == 0
    assert list(runner.inputs) == ["sample"] and runner.inputs["sample"].shape == (2, 4, 8, 8)


def test_one_context_and_one_set_of_buffers_over_many_calls(tmp_path):
    rig = Rig(tmp_path)
    runner = rig.runner("unet")
    for seed in range(5):
        feeds = _sample(seed=seed)
        out = runner.run(feeds)["out"]
        np.testing.assert_array_equal(out, feeds["sample"] * 2 + 1)  # through pinned host + device buffers
    assert rig.loads == ["unet"] and len(rig.trt.contexts) == 1
    assert (runner.stats.contexts_created, runner.stats.activations, runner.stats.runs) == (1, 1, 5)
    assert runner.stats.device_allocations == runner.stats.host_allocations == 2  # one buffer per I/O tensor
    assert rig.cudart.calls["cudaMalloc"] == 3  # the two buffers + the shared activation allocation
    assert rig.cudart.calls["cudaMallocHost"] == 2 and rig.cudart.calls["cudaStreamCreateWithFlags"] == 1
    assert rig.cudart.calls["cudaMemcpyAsync(HtoD)"] == rig.cudart.calls["cudaMemcpyAsync(DtoH)"] == 5
    assert rig.trt.contexts[0]._calls["execute_async_v3"] == 5


def test_deactivate_frees_everything_and_can_activate_again(tmp_path):
    rig = Rig(tmp_path)
    with rig.runner("unet") as runner:
        assert runner.active and rig.cudart.live_device == 3 and rig.cudart.live_host == 2
        runner.run(_sample())
    assert not runner.active
    assert rig.cudart.live_device == 0 and rig.cudart.live_host == 0 and not rig.cudart.streams
    assert rig.group.activation_bytes == 0 and rig.group.members == []
    np.testing.assert_array_equal(runner.run(_sample(seed=3))["out"], _sample(seed=3)["sample"] * 2 + 1)
    assert runner.stats.activations == 2 and rig.loads == ["unet", "unet"]


def test_dynamic_shapes_reuse_the_buffers_sized_for_the_profile_max(tmp_path):
    rig = Rig(tmp_path)
    runner = rig.runner("unet", DYNAMIC)
    for shape in [(1, 4, 8, 8), (4, 4, 16, 16), (3, 4, 8, 12), (1, 4, 8, 8)]:
        feeds = _sample(shape)
        out = runner.run(feeds)["out"]
        assert out.shape == shape
        np.testing.assert_array_equal(out, feeds["sample"] * 2 + 1)
    assert runner.stats.device_allocations == 2 and runner.stats.contexts_created == 1
    assert runner._buffers["sample"].capacity == dm.align_up(dm.tensor_bytes((4, 4, 16, 16), "float32"))


def test_wrong_feeds_fail_before_anything_loads(tmp_path):
    rig = Rig(tmp_path)
    runner = rig.runner("unet")
    with pytest.raises(RuntimeInputError, match=r"sample: dtype float16, expected float32"):
        runner.run({"sample": np.zeros((2, 4, 8, 8), np.float16)})
    with pytest.raises(RuntimeInputError, match=r"outside the engine's profile"):
        runner.run(_sample((2, 4, 8, 16)))
    with pytest.raises(RuntimeInputError, match=r"missing input"):
        runner.run({})
    assert rig.loads == [] and sum(rig.cudart.calls.values()) == 0


def test_engines_of_a_group_share_one_activation_allocation(tmp_path):
    rig = Rig(tmp_path)
    small = rig.runner("text_encoder", activation_bytes=1000)
    large = rig.runner("unet", activation_bytes=5000)
    small.run(_sample())
    first = rig.group.activation_pointer
    assert rig.group.activation_bytes == 1024 and small.context._activation == (first, 1024)
    large.run(_sample())  # a larger need: one new allocation, the earlier context rebound to it
    pointer = rig.group.activation_pointer
    assert pointer != first and rig.group.activation_bytes == 5120
    assert small.context._activation == large.context._activation == (pointer, 5120)
    assert rig.group.stats["activation_allocations"] == 2 and rig.group.stats["activation_frees"] == 1
    small.run(_sample())  # runs in the shared allocation (the fake refuses a too-small one)
    assert rig.cudart.live_device == 1 + 2 * 2  # one activation allocation, two buffers per engine


def test_cuda_graph_captured_once_for_static_shapes_and_replayed(tmp_path):
    rig = Rig(tmp_path)
    graph = rig.runner("unet", cuda_graph=True)
    eager = rig.runner("unet_eager")
    for seed in range(4):
        feeds = _sample(seed=seed)
        np.testing.assert_array_equal(graph.run(feeds)["out"], eager.run(feeds)["out"])  # replay == eager
    # first call eager (TensorRT's deferred work happens outside a capture), then one capture, then launches
    assert (graph.stats.eager_runs, graph.stats.graph_captures, graph.stats.graph_launches) == (1, 1, 3)
    assert rig.cudart.calls["cudaGraphInstantiate"] == 1 and eager.stats.graph_captures == 0


def test_no_cuda_graph_for_a_dynamic_profile(tmp_path):
    rig = Rig(tmp_path)
    runner = rig.runner("unet", DYNAMIC, cuda_graph=True)
    for _ in range(3):
        runner.run(_sample((2, 4, 8, 8)))
    assert runner.stats.graph_captures == 0 and runner.stats.eager_runs == 3
    assert "dynamic-shape" in runner.stats.graph_skip_reason


def test_graph_recaptured_after_the_shared_activation_moves(tmp_path):
    rig = Rig(tmp_path)
    runner = rig.runner("unet", cuda_graph=True, activation_bytes=1000)
    for _ in range(3):
        runner.run(_sample())
    rig.runner("vae", activation_bytes=9000).run(_sample())  # the shared allocation grows and moves
    feeds = _sample(seed=9)
    for _ in range(2):
        np.testing.assert_array_equal(runner.run(feeds)["out"], feeds["sample"] * 2 + 1)
    assert runner.stats.graph_captures == 2  # the old graph recorded the old address: never replayed


def test_memory_bound_unloads_the_least_recently_used_engine(tmp_path):
    rig = Rig(tmp_path, bound_bytes=1 << 20)  # KiB for MiB: the plans are written and hashed
    a = rig.runner("unet.512", plan_bytes=600 << 10, activation_bytes=1 << 10)
    b = rig.runner("unet.1024", plan_bytes=600 << 10, activation_bytes=1 << 10)
    a.run(_sample())
    b.run(_sample())  # both do not fit: a (least recently used, not running) is unloaded first
    assert not a.active and b.active and rig.group.members == [b.key]
    assert rig.cudart.live_device == 1 + 2 and rig.cudart.live_host == 2  # a's buffers are freed
    a.run(_sample())
    assert a.active and not b.active and rig.loads == ["unet.512", "unet.1024", "unet.512"]


def test_an_engine_entered_with_with_is_never_unloaded(tmp_path):
    rig = Rig(tmp_path, bound_bytes=1 << 20)
    a = rig.runner("unet.512", plan_bytes=600 << 10, activation_bytes=1 << 10)
    b = rig.runner("unet.1024", plan_bytes=600 << 10, activation_bytes=1 << 10)
    with a:
        with pytest.raises(dm.MemoryBudgetError, match=r"engine unet.1024@.* needs .*held in use. Raise TRT_DIFFUSION_TENSORRT_MEMORY_GB"):
            b.run(_sample())
        assert a.active and not b.active
    assert rig.cudart.live_device == 0 and rig.cudart.live_host == 0


def test_a_plan_refitted_on_disk_is_refused_until_the_runner_reloads(tmp_path):
    """#27 item 4: `trt-diffusion refit` rewrites the plan and manifest in place; a runner that loaded the old plan
    (or that would lazily reload after an unload) must not switch LoRA silently."""
    from trt_diffusion.targets.tensorrt.target import save_refitted_plan

    rig = Rig(tmp_path)
    runner = rig.runner("unet")
    runner.run(_sample())
    save_refitted_plan(runner.path, runner.manifest, b"\1" * 1000, {"w": np.ones(3, np.float32)})
    with pytest.raises(RuntimeInputError, match=r"refitted on disk .* runner.reload\(\)"):
        runner.run(_sample())
    runner.deactivate()  # nor does a lazy load after an unload take it
    with pytest.raises(RuntimeInputError, match="refitted on disk"):
        runner.run(_sample())
    runner.reload()  # explicitly: the runner now describes and runs the refitted plan
    assert runner.manifest.refit is not None and runner.manifest.refit.names == ("w",)
    np.testing.assert_array_equal(runner.run(_sample())["out"], _sample()["sample"] * 2 + 1)
    assert rig.loads == ["unet", "unet"]


# ---------------------------------------------------------------------------------------------- cuda-python names


def _cudart_calls() -> set[str]:
    """Every `self._rt.<name>` the Cuda wrapper calls, read from its source."""
    source = Path(importlib.import_module("trt_diffusion.targets.tensorrt.cudart").__file__).read_text()
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "_rt"}


def test_the_fake_cuda_runtime_has_every_call_the_wrapper_makes():
    assert _cudart_calls() <= set(dir(fake.FakeCudart)), _cudart_calls() - set(dir(fake.FakeCudart))


def test_the_wrapper_and_the_fake_name_only_real_cuda_python_calls():
    runtime = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed (the tensorrt extra)")
    missing = sorted(n for n in _cudart_calls() | set(fake.CUDART_NAMES) if not hasattr(runtime, n))
    assert not missing, f"not in cuda-python's cuda.bindings.runtime: {missing}"


# ---------------------------------------------------------------------------------------------- the pipeline


def test_pipeline_keeps_latents_on_the_host_unless_every_denoiser_runner_takes_device_tensors(monkeypatch, tmp_path):
    """The device path is chosen only for runners that say `device_tensors` and only where torch has CUDA
    (never here); everything else keeps the host path that tests/runtime checks bit for bit against diffusers."""
    import torch

    from trt_diffusion.runtime.engines import RunnerTable
    from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
    from trt_diffusion.runtime.runners import CallableRunner

    rig = Rig(tmp_path)
    request = GenerationRequest(prompt="x", height=64, width=64)

    def device(*runners):
        table = RunnerTable()
        for runner in runners:
            table.add("unet", runner)
        return EnginePipeline._latent_device(SimpleNamespace(runners=table, denoiser="unet"), request)

    trt_runner, host_runner = rig.runner("unet"), CallableRunner(lambda f: f, {}, name="host")
    assert device(trt_runner) is None  # torch without CUDA on this machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device(trt_runner) == "cuda"
    assert device(trt_runner, host_runner) is None  # one runner on the host: the host path for all
    request.controlnet = "canny"
    assert device(trt_runner) is None  # ControlNet residuals are computed on the host


# ---------------------------------------------------------------------------------------------- asynchronous CUDA
# (#27 items 3 and 7) tests/shared/tensorrt_async_cuda.py: queued streams, real event semantics, injectable
# allocation failure. The synchronous stand-in above runs every copy at once, so it cannot show ordering bugs.


@pytest.fixture
def async_rig(tmp_path, monkeypatch):
    from tensorrt_async_cuda import AsyncCudart, FakeCudaTensor

    from trt_diffusion.targets.tensorrt import runner as runner_module

    cudart = AsyncCudart()
    rig = Rig(tmp_path, cudart=cudart)
    rig.torch_stream = cudart.external_stream()
    rig.allocated = []
    monkeypatch.setattr(runner_module, "_torch_stream", lambda: rig.torch_stream)

    def device_empty(shape, dtype):
        out = FakeCudaTensor(cudart, cudart.cudaMalloc(max(dm.tensor_bytes(shape, dtype), 1))[1], shape,
                             dm.torch_dtype_name(dtype), torch_stream=rig.torch_stream)
        rig.allocated.append(out)
        return out

    monkeypatch.setattr(runner_module, "_device_empty", device_empty)
    rig.tensor = lambda array, contiguous=True: FakeCudaTensor.produced(cudart, rig.torch_stream, array,
                                                                        contiguous=contiguous)
    return rig


def test_device_feeds_wait_for_torchs_contiguous_copies(async_rig):
    """`.contiguous()` of a non-contiguous tensor queues a copy on torch's stream: the runner's stream must wait
    for it, so the event is recorded after every `.contiguous()`, not before (today's order read zeros)."""
    rig = async_rig
    runner = rig.runner("unet")
    sample = _sample()["sample"]
    out = runner.run({"sample": rig.tensor(sample, contiguous=False)})["out"]
    rig.cudart.run_stream(rig.group.stream)  # the runner's stream first, as far as its waits let it: a legal order
    np.testing.assert_array_equal(out.numpy_after(rig.torch_stream), sample * 2 + 1)


def test_device_outputs_are_ready_on_torchs_stream_only_after_the_engine_ran(async_rig):
    rig = async_rig
    runner = rig.runner("unet", cuda_graph=True)
    for seed in range(3):  # eager, capture, replay: each output waited for on torch's stream
        sample = _sample(seed=seed)["sample"]
        out = runner.run({"sample": rig.tensor(sample)})["out"]
        assert rig.cudart.pending(rig.group.stream) > 0  # nothing ran yet: no host sync on the device path
        np.testing.assert_array_equal(out.numpy_after(rig.torch_stream), sample * 2 + 1)
    assert runner.stats.graph_launches == 2


def test_host_path_reads_its_pinned_buffers_only_after_the_copies_ran(async_rig):
    rig = async_rig
    runner = rig.runner("unet", DYNAMIC)
    for seed, shape in enumerate([(1, 4, 8, 8), (4, 4, 16, 16), (2, 4, 8, 12)]):
        feeds = _sample(shape, seed)
        np.testing.assert_array_equal(runner.run(feeds)["out"], feeds["sample"] * 2 + 1)


def test_fp8_device_outputs_are_torchs_float8_e4m3fn(async_rig, monkeypatch):
    """#27 item 7: a manifest says `float8e4m3`; torch's dtype is `float8_e4m3fn` (`torch.float8e4m3` does not
    exist: the device path raised AttributeError for every fp8 output)."""
    import torch

    from trt_diffusion.targets.tensorrt import runner as runner_module
    from trt_diffusion.targets.tensorrt.dtypes import TRT_DTYPE_NAMES

    for name in TRT_DTYPE_NAMES.values():
        if name not in dm.NO_TORCH_DTYPE:
            assert isinstance(getattr(torch, dm.torch_dtype_name(name)), torch.dtype), name
    monkeypatch.setitem(fake.NUMPY_OF, "FP8", np.uint8)
    made = []
    monkeypatch.setattr(torch, "empty", lambda shape, dtype, device: made.append(dtype) or _fp8_tensor(async_rig, shape))
    monkeypatch.setattr(runner_module, "_device_empty", REAL_DEVICE_EMPTY)  # the runner's own dtype mapping
    (low, _, high), = STATIC.values()
    description = fake.EngineDescription(
        inputs={"sample": ("FLOAT", low, low, high)}, outputs={"out": "FP8"},
        output_shape=lambda shapes: {"out": shapes.get("sample", high)},
        compute=lambda feeds: {"out": np.full(feeds["sample"].shape, 0x38, np.uint8)})  # 1.0 in e4m3
    runner = async_rig.runner("unet_fp8", description=description, output_dtype="float8e4m3")
    out = runner.run({"sample": async_rig.tensor(_sample()["sample"])})["out"]
    assert made == [torch.float8_e4m3fn]
    assert (out.numpy_after(async_rig.torch_stream) == 0x38).all()


def _fp8_tensor(rig, shape):
    from tensorrt_async_cuda import FakeCudaTensor

    return FakeCudaTensor(rig.cudart, rig.cudart.cudaMalloc(int(np.prod(shape)))[1], shape, "float8_e4m3fn",
                          torch_stream=rig.torch_stream)


def _bound_to_live_memory(rig) -> bool:
    return all(c._activation is None or c._activation[0] in rig.cudart.device for c in rig.trt.contexts
               if c._activation and c._activation[1])


def test_a_failed_activation_malloc_leaves_no_context_bound_to_freed_memory(async_rig):
    """#27 item 3: bind_activation freed the shared allocation before allocating the larger one; a failed
    cudaMalloc left every member (and its captured graph) bound to the freed pointer."""
    rig = async_rig
    small = rig.runner("text_encoder", activation_bytes=1000, cuda_graph=True)
    for _ in range(3):
        small.run(_sample())  # eager, capture, replay
    rig.cudart.fail_malloc(1)  # the larger allocation fails once: freeing the old one first makes room
    rig.runner("unet", activation_bytes=9000).run(_sample())
    assert _bound_to_live_memory(rig)
    rig.cudart.fail_malloc(2)  # and when it fails for good
    with pytest.raises(Exception, match="cudaErrorMemoryAllocation"):
        rig.runner("vae", activation_bytes=90000).run(_sample())
    assert _bound_to_live_memory(rig)
    feeds = _sample(seed=4)  # the earlier members rebind; no graph replays into the freed allocation
    np.testing.assert_array_equal(small.run(feeds)["out"], feeds["sample"] * 2 + 1)
    assert _bound_to_live_memory(rig)


def test_admission_budgets_the_activation_memory_the_manifest_records(tmp_path):
    """#27 item 3: `admit` never passed `shared_after`, so an engine whose activation memory did not fit was
    loaded anyway and the bound exceeded; the manifest's `device_memory_bytes` is budgeted before the load."""
    mib = 1 << 10  # KiB stand for MiB: the budget is unit-free, and the fake allocates what it is asked
    rig = Rig(tmp_path, bound_bytes=1024 * mib)
    a = rig.runner("unet.512", plan_bytes=400 * mib, activation_bytes=100 * mib, device_memory_bytes=100 * mib)
    b = rig.runner("unet.1024", plan_bytes=400 * mib, activation_bytes=300 * mib, device_memory_bytes=300 * mib)
    a.run(_sample())
    b.run(_sample())  # 400 + 400 + 300 > 1024: a goes first
    assert not a.active and b.active
    assert rig.group.budget.used_bytes <= rig.group.budget.bound_bytes


def test_in_process_refit_is_queued_on_the_stream_and_drops_the_captured_graph(async_rig, monkeypatch):
    """#27 item 7 and the hot-swap design: `runner.refit` queues `refit_cuda_engine_async` on the runner's stream
    (after the runs already queued, before later ones), drops the captured graph and records the LoRA in the
    in-memory manifest."""
    from trt_diffusion.targets.tensorrt.refit_weights import weights_digest

    rig = async_rig
    runner = rig.runner("unet", cuda_graph=True)
    for _ in range(3):
        runner.run({"sample": rig.tensor(_sample()["sample"])})  # device path: nothing synchronized
    calls = []

    def refit_engine(engine, weights, base_weights=None, stream_handle=None):
        calls.append((stream_handle, rig.cudart.pending(rig.group.stream)))
        rig.cudart.enqueue(stream_handle, "refit", lambda: None)

    monkeypatch.setattr(trt_refit, "refit_engine", refit_engine)
    lora = {"w": np.ones(3, np.float32)}
    runner.refit(lora)
    assert calls == [(int(rig.group.stream), calls[0][1])] and calls[0][1] > 0  # queued behind the pending runs
    assert runner._graph is None and rig.cudart.calls["cudaGraphExecDestroy"] == 1
    assert runner.manifest.refit.weights_sha256 == weights_digest(lora)
    out = runner.run({"sample": rig.tensor(_sample(seed=5)["sample"])})["out"]
    labels = [label for label, _ in rig.cudart.queues[int(rig.group.stream)] if label != "wait"]
    assert labels.index("refit") < len(labels) - 1 - labels[::-1].index("execute")  # the refit before the next run
    np.testing.assert_array_equal(out.numpy_after(rig.torch_stream), _sample(seed=5)["sample"] * 2 + 1)
    assert runner.stats.graph_captures == 1 and runner.stats.eager_runs == 2  # warm-up again after the refit



# ---------------------------------------------------------------------------------------------- LoRA hot swap


def _refit_tensorrt(rig, stored: dict):
    """The `tensorrt` of the refit calls: a Refitter generated from the stubs (names and argument types checked)
    that takes device weights only, and whose `refit_cuda_engine_async` queues on the stream a read of every weight
    it was given: the engine's weights (`stored`) change only when that stream runs, from device memory that must
    still be allocated then (the asynchronous fake CUDA refuses reads of freed memory)."""
    import importlib.machinery
    import types

    classes = rig.trt.classes
    data_type, location = fake.make_enum(classes["DataType"]), fake.make_enum(classes["TensorLocation"])

    class Weights:
        def __init__(self, dtype, ptr, count):
            self.dtype, self.ptr, self.count = dtype, ptr, count

    def behaviours():
        def get_weights_prototype(self, weights_name):
            return SimpleNamespace(dtype=data_type.FLOAT, size=stored[weights_name].size if weights_name in stored
                                   else -1)

        def set_named_weights(self, name, weights, location):
            if location is not data_type_location.DEVICE or name not in stored:
                return False
            self._pending[name] = weights
            return True

        def get_missing_weights(self):
            return []

        def refit_cuda_engine_async(self, stream_handle):
            pending = dict(self._pending)

            def refit():
                for name, weights in pending.items():
                    stored[name] = rig.cudart.read(weights.ptr, np.float32, (weights.count,)).copy()

            rig.cudart.enqueue(stream_handle, "refit", refit)
            rig.refits += 1
            return True

        return fake._functions(locals())

    data_type_location = location
    refitter = fake.make_class(classes["Refitter"], behaviours())
    refitter.__init__ = lambda self, engine, logger: object.__setattr__(self, "_pending", {})
    module = types.ModuleType("tensorrt")
    module.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    module.Refitter, module.Weights, module.TensorLocation, module.DataType = refitter, Weights, location, data_type
    return module


def test_hot_swap_uploads_each_lora_set_once_keeps_it_on_the_device_and_frees_it_with_the_engine(
        async_rig, monkeypatch):
    """`runner.refit(w, base_weights=..., resident=True)`: a LoRA set is uploaded to the GPU once (cast, copied on
    the runner's stream, one sync), the base values of the weights it changes once too; a swap back to a resident
    set allocates, copies and synchronizes nothing — the refit reads device memory on the stream; beyond
    `resident_lora_sets` the least recently used set is freed (after the stream ran the refits reading it), and
    everything resident is freed when the engine unloads."""
    import sys

    from trt_diffusion.targets.tensorrt import engine as trt_engine

    rig = async_rig
    rig.refits = 0
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal(4096).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    stored = {name: array.copy() for name, array in base.items()}  # what the engine holds
    module = _refit_tensorrt(rig, stored)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: module)
    monkeypatch.setattr(trt_log, "trt_logger", lambda: None)
    plan = _plan(rig.tmp_path, "unet", STATIC, flags={"refit": True})

    def load(path):
        return trt_engine.TensorRTEngine(path, EngineManifest.read(manifest_path(path)),
                                         rig.trt.engine(_description(STATIC), rig.cudart))

    runner = TensorRTRunner(plan, name="unet", group=rig.group, loader=load, trt_module=rig.trt, resident_lora_sets=2)
    runner.run(_sample())
    lora_a = {"w": base["w"] + 1}
    lora_b = {"b": base["b"] * 2, "w": base["w"] - 1}
    lora_c = {"b": base["b"] + 5}
    counts = rig.cudart.calls
    held = rig.group.budget.used_bytes

    runner.refit(lora_a, base_weights=base, resident=True)
    assert runner.stats.extra["resident_uploads"] == 1 and rig.refits == 1
    np.testing.assert_array_equal(stored["w"], base["w"])  # queued, not run: the refit is asynchronous
    runner.run(_sample())  # the host path synchronizes: the refit ran first
    np.testing.assert_array_equal(stored["w"], lora_a["w"])
    assert rig.group.budget.used_bytes == held + 4096 * 4  # device-resident weights count against the bound

    runner.refit(lora_b, base_weights=base, resident=True)  # B's set; nothing of A is stale (B sets w too)
    rig.cudart.run_stream(rig.group.stream)
    np.testing.assert_array_equal(stored["w"], lora_b["w"])
    np.testing.assert_array_equal(stored["b"], lora_b["b"])

    before = dict(counts)
    runner.refit(lora_a, base_weights=base, resident=True)  # A again: b back to base, from the device too
    swap = {k: counts[k] - before.get(k, 0) for k in counts if counts[k] != before.get(k, 0)}
    assert swap == {"cudaMalloc": 1, "cudaMemcpyAsync(HtoD)": 1, "cudaStreamSynchronize": 1}  # base b, once
    rig.cudart.run_stream(rig.group.stream)
    np.testing.assert_array_equal(stored["w"], lora_a["w"])
    np.testing.assert_array_equal(stored["b"], base["b"])
    before = dict(counts)
    runner.refit(lora_b, base_weights=base, resident=True)
    runner.refit(lora_a, base_weights=base, resident=True)  # both resident now, base b too: pure device swaps
    assert {k: counts[k] - before.get(k, 0) for k in counts if counts[k] != before.get(k, 0)} == {}
    assert runner.stats.extra["resident_reuses"] == 3 and runner.stats.extra["resident_uploads"] == 3
    rig.cudart.run_stream(rig.group.stream)
    np.testing.assert_array_equal(stored["w"], lora_a["w"])

    frees = counts["cudaFree"]
    runner.refit(lora_c, base_weights=base, resident=True)  # a third set: B (least recently used) is freed
    assert counts["cudaFree"] - frees == 2 and runner.stats.extra["resident_frees"] == 2
    rig.cudart.run_stream(rig.group.stream)  # the queued refits never read freed memory
    np.testing.assert_array_equal(stored["b"], lora_c["b"])
    np.testing.assert_array_equal(stored["w"], base["w"])  # A's w went back to base with C
    live = rig.cudart.live_device
    runner.deactivate()  # the engine unloads: every resident weight is freed with it
    assert runner.stats.extra["resident_frees"] == 2 + 1 + 2 + 1  # A's w, C's b, base w and b
    assert rig.cudart.live_device == 0 and live > 0
    assert not runner._resident_sets and not runner._resident_base and rig.group.budget.used_bytes == 0


def test_a_resident_refit_refuses_to_leave_residue_and_base_onnx(async_rig, monkeypatch):
    import sys

    from trt_diffusion.errors import RefitError
    from trt_diffusion.targets.tensorrt import engine as trt_engine

    rig = async_rig
    rig.refits = 0
    stored = {"w": np.zeros(8, np.float32)}
    module = _refit_tensorrt(rig, stored)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: module)
    monkeypatch.setattr(trt_log, "trt_logger", lambda: None)
    plan = _plan(rig.tmp_path, "unet", STATIC, flags={"refit": True})
    runner = TensorRTRunner(plan, name="unet", group=rig.group, trt_module=rig.trt, loader=lambda path: (
        trt_engine.TensorRTEngine(path, EngineManifest.read(manifest_path(path)),
                                  rig.trt.engine(_description(STATIC), rig.cudart))))
    runner.refit({"w": np.ones(8, np.float32)}, resident=True)
    with pytest.raises(RefitError, match="pass the base weights"):
        runner.refit(None, resident=True)  # w would keep the LoRA's values
    with pytest.raises(RuntimeInputError, match="restores from base_weights, not base_onnx"):
        runner.refit(None, base_onnx="x.onnx", resident=True)


# ---------------------------------------------------------------------------------------------- engine_layout: profiles


def test_a_multi_profile_engine_runs_each_shape_in_its_profile(tmp_path):
    """One engine, weights once, one profile per bucket: the runner selects the profile a request fits
    (set_optimization_profile_async), sets every input shape again after a switch, and keeps one set of buffers
    sized for the largest profile."""
    from trt_diffusion.targets.tensorrt.layout import profile_envelope

    profiles = [{"sample": ((2, 4, 8, 8),) * 3}, {"sample": ((2, 4, 16, 16),) * 3},
                {"sample": ((1, 4, 8, 8), (1, 4, 12, 12), (1, 4, 24, 24))}]
    envelope = profile_envelope(profiles)
    (low, opt, high), = envelope.values()
    description = fake.EngineDescription(
        inputs={"sample": ("FLOAT", low, opt, high)}, outputs={"out": "FLOAT"},
        output_shape=lambda shapes: {"out": shapes["sample"]}, compute=lambda feeds: {"out": feeds["sample"] * 2 + 1},
        profiles=profiles)
    rig = Rig(tmp_path)
    runner = rig.runner("unet", envelope, description=description, profiles=profiles)
    for shape in [(2, 4, 8, 8), (2, 4, 16, 16), (1, 4, 20, 20), (2, 4, 8, 8), (2, 4, 8, 8)]:
        feeds = _sample(shape)
        np.testing.assert_array_equal(runner.run(feeds)["out"], feeds["sample"] * 2 + 1)
    context = rig.trt.contexts[0]
    assert context._profile == 0 and len(rig.trt.contexts) == 1 and runner.stats.device_allocations == 2
    assert runner._buffers["sample"].capacity == dm.align_up(dm.tensor_bytes((1, 4, 24, 24), "float32"))
    # activation sizing visits profiles 2, 1, 0; then the runs switch 0 -> 1 -> 2 -> 0
    assert context._calls["set_optimization_profile_async"] == 3 + 3
    with pytest.raises(RuntimeInputError, match=r"fit none of the engine's 3 profiles"):
        runner.run(_sample((2, 4, 12, 12)))  # inside the envelope, inside no profile



# ---------------------------------------------------------------------------------------------- weight streaming


def test_a_weight_streaming_budget_is_set_before_the_context_and_budgeted_at_admission(tmp_path):
    """Two 800 MiB engines whose 600 MiB of streamable weights keep 100 MiB on the GPU each fit a 1 GiB bound
    together; without the budget the first is unloaded for the second."""
    mib = 1 << 10  # KiB stand for MiB (plans are written and hashed, activations allocated, by the fakes)
    rig = Rig(tmp_path, bound_bytes=1024 * mib)
    streaming = dict(plan_bytes=800 * mib, activation_bytes=mib, flags={"weight_streaming": True},
                     streamable_weights_bytes=600 * mib,
                     runner_options={"weight_budget_bytes": 100 * mib})
    a, b = rig.runner("flux.512", **streaming), rig.runner("flux.1024", **streaming)
    a.run(_sample())
    b.run(_sample())
    assert a.active and b.active and rig.group.budget.used_bytes <= 1024 * mib
    assert a.engine.engine.weight_streaming_budget_v2 == 100 * mib
    c = rig.runner("flux.2048", plan_bytes=800 * mib, activation_bytes=mib, flags={"weight_streaming": True},
                   streamable_weights_bytes=600 * mib)  # no budget: all 800 MiB resident
    c.run(_sample())
    assert c.active and not a.active
    with pytest.raises(dm.MemoryBudgetError, match="not built with weight streaming"):
        rig.runner("unet", runner_options={"weight_budget_bytes": 0}).run(_sample())
    assert dm.weight_streaming_budget(10 * mib, 6 * mib, True, "e") == 6 * mib  # capped at the streamable size
    assert dm.resident_bytes(800, 600, 0) == 200 and dm.resident_bytes(800, None, 0) == 800


# ---------------------------------------------------------------------------------------------- device choice


def test_a_group_on_gpu_n_makes_it_current_in_every_calling_thread(tmp_path):
    """A Triton instance group on GPU 1: every allocation and launch of its runners happens with GPU 1 current,
    whichever thread calls (CUDA's current device is per thread)."""
    import threading

    rig = Rig(tmp_path)
    rig.group = EngineGroup(cuda=Cuda(rig.cudart), bound_bytes=1 << 30, device=1)
    runner = rig.runner("unet")
    rig.cudart.current_device = 0
    runner.run(_sample())
    assert rig.cudart.malloc_devices == {1}
    rig.cudart.current_device = 0  # another thread's default
    worker = threading.Thread(target=lambda: runner.run(_sample()))
    worker.start()
    worker.join()
    assert rig.cudart.current_device == 1 and rig.cudart.calls["cudaSetDevice"] >= 2
    with pytest.raises(RuntimeInputError, match="its group is on GPU 1, not GPU 0"):
        TensorRTRunner(runner.path, group=rig.group, device=0)


# ---------------------------------------------------------------------------------------------- #45 fourth pass


def test_every_in_process_refit_is_queued_on_the_stream_a_restore_to_base_too(async_rig, monkeypatch):
    """#45 item 2: `refit(None, base_weights=...)` went through `refit_to_base`, which called the synchronous
    `refit_cuda_engine` (no stream) while the engine still had runs queued: undefined in TensorRT."""

    rig = async_rig
    runner = rig.runner("unet")
    runner.run({"sample": rig.tensor(_sample()["sample"])})  # queued, not run
    handles = []

    def refit_engine(engine, weights, base_weights=None, stream_handle=None):
        handles.append(stream_handle)
        rig.cudart.enqueue(rig.group.stream if stream_handle is None else stream_handle, "refit", lambda: None)

    monkeypatch.setattr(trt_refit, "refit_engine", refit_engine)
    base = {"w": np.zeros(3, np.float32)}
    runner.refit({"w": np.ones(3, np.float32)}, base_weights=base)
    runner.engine.refitted_names = {"w"}
    runner.refit(None, base_weights=base)  # back to base
    assert handles == [int(rig.group.stream)] * 2


def test_device_feeds_step_after_step_never_synchronize_the_host(async_rig):
    """#45 item 9: every device-path call set `_pending`, so the next one synchronized the stream before starting:
    a host round trip per denoising step, though no pinned buffer was in use."""
    rig = async_rig
    runner = rig.runner("unet")
    runner.run({"sample": rig.tensor(_sample()["sample"])})  # activation (allocations, binding)
    syncs = rig.cudart.calls["cudaStreamSynchronize"]
    for seed in range(4):
        sample = _sample(seed=seed)["sample"]
        out = runner.run({"sample": rig.tensor(sample)})["out"]
        np.testing.assert_array_equal(out.numpy_after(rig.torch_stream), sample * 2 + 1)
    assert rig.cudart.calls["cudaStreamSynchronize"] == syncs


def test_a_profile_tensorrt_refuses_by_raising_is_a_clear_runner_error(tmp_path, monkeypatch):
    """#45 item 11: the bindings raise where `setOptimizationProfileAsync` returns false, so `if not ...` never
    fired and the raw binding error escaped; it is the runner's error naming the profile."""
    from trt_diffusion.targets.tensorrt.layout import profile_envelope

    profiles = [{"sample": ((2, 4, 8, 8),) * 3}, {"sample": ((2, 4, 16, 16),) * 3}]
    envelope = profile_envelope(profiles)
    (low, opt, high), = envelope.values()
    description = fake.EngineDescription(
        inputs={"sample": ("FLOAT", low, opt, high)}, outputs={"out": "FLOAT"},
        output_shape=lambda shapes: {"out": shapes["sample"]}, compute=lambda feeds: {"out": feeds["sample"] * 2 + 1},
        profiles=profiles)
    rig = Rig(tmp_path)
    runner = rig.runner("unet", envelope, description=description, profiles=profiles)
    runner.run(_sample((2, 4, 8, 8)))
    context_class = type(rig.trt.contexts[0])

    def refuse(self, profile_index, stream_handle):
        raise RuntimeError("Error Code 3: API Usage Error (profile already in use by another context)")

    monkeypatch.setattr(context_class, "set_optimization_profile_async", refuse)
    with pytest.raises(RuntimeInputError, match=r"unet: TensorRT refused optimization profile 1 .*API Usage Error"):
        runner.run(_sample((2, 4, 16, 16)))


def test_hot_swaps_share_one_refitter_without_tensorrts_revalidation_and_refuse_non_finite_weights(
        async_rig, monkeypatch):
    """#45 item 11: each swap made a new Refitter and left `weights_validation` on (TensorRT reads every weight
    again to look for NaN/inf on each swap). One Refitter per loaded engine now, validation off: the runner checks
    the values once, on the host, when it uploads a set (NaN refused, naming the weight)."""
    import sys

    from trt_diffusion.errors import RefitError
    from trt_diffusion.targets.tensorrt import engine as trt_engine

    rig = async_rig
    rig.refits = 0
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal(64).astype(np.float32)}
    stored = {name: array.copy() for name, array in base.items()}
    module = _refit_tensorrt(rig, stored)
    made, validation = [], []
    init = module.Refitter.__init__

    def counted(self, engine, logger):
        made.append(engine)
        init(self, engine, logger)

    refit_async = module.Refitter.refit_cuda_engine_async

    def recording(self, stream_handle):
        validation.append(self.weights_validation)
        return refit_async(self, stream_handle)

    module.Refitter.__init__ = counted
    module.Refitter.refit_cuda_engine_async = recording
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    monkeypatch.setattr(host_probe, "require_tensorrt", lambda: module)
    monkeypatch.setattr(trt_log, "trt_logger", lambda: None)
    plan = _plan(rig.tmp_path, "unet", STATIC, flags={"refit": True})
    runner = TensorRTRunner(plan, name="unet", group=rig.group, trt_module=rig.trt, loader=lambda path: (
        trt_engine.TensorRTEngine(path, EngineManifest.read(manifest_path(path)),
                                  rig.trt.engine(_description(STATIC), rig.cudart))))
    for weights in ({"w": base["w"] + 1}, {"w": base["w"] - 1}, {"w": base["w"] + 1}, None):
        runner.refit(weights, base_weights=base, resident=True)
    rig.cudart.run_stream(rig.group.stream)
    np.testing.assert_array_equal(stored["w"], base["w"])
    assert rig.refits == 4 and len(made) == 1 and validation == [False] * 4
    bad = base["w"].copy()
    bad[3] = np.nan
    with pytest.raises(RefitError, match=r"weight\(s\) \['w'\] hold NaN or infinity"):
        runner.refit({"w": bad}, base_weights=base, resident=True)
    assert rig.refits == 4


def test_a_cuda_failure_is_internal_and_an_allocation_the_gpu_has_no_room_for_names_the_engine_and_bytes(
        async_rig, monkeypatch):
    """#45: CudaError was a user error (exit 1, no traceback) though only a bug or a broken driver causes one; it is
    internal now (exit 3, with the traceback). Out of GPU memory is the user's to act on: a ServeError naming the
    engine and the bytes it needed."""
    import typer

    from trt_diffusion.errors import InternalError, ServeError, TrtDiffusionError
    from trt_diffusion.targets.tensorrt.cudart import CudaError

    assert issubclass(CudaError, InternalError) and not issubclass(CudaError, TrtDiffusionError)
    cli_main = importlib.import_module("trt_diffusion.cli.main")
    monkeypatch.setattr(typer.main, "get_command", lambda app: SimpleNamespace(
        main=lambda **kwargs: (_ for _ in ()).throw(CudaError("CUDA call cudaStreamSynchronize failed: x"))))
    assert cli_main.main(["build"]) == cli_main.EXIT_INTERNAL

    rig = async_rig
    rig.cudart.fail_malloc(2)  # the activation allocation, and its retry
    with pytest.raises(ServeError, match=r"unet: the GPU has no room for 9216 more bytes .*cudaErrorMemoryAllocation"):
        rig.runner("unet", activation_bytes=9000).run(_sample())
