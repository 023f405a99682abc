"""The TensorRT runner's asynchrony on a real GPU without TensorRT (#27 items 3 and 8): the CUDA-only gpu tests.

The runner's CUDA calls are real (cuda-python: streams, events, pinned copies, graph capture and replay); the
engine is a stand-in whose `execute_async_v3` queues torch kernels on the stream it is given (through
`torch.cuda.ExternalStream`, on the runner's buffers by `__cuda_array_interface__`), so ordering bugs show as
wrong numbers, as they would with TensorRT. What the CPU's asynchronous fake (tests/shared/tensorrt_async_cuda.py)
claims, checked against CUDA itself. Marked `gpu` only: `make test-gpu` runs these where TensorRT is missing too.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from trt_diffusion.targets.tensorrt.host_check import torch_cuda_reason  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda():
    reason = torch_cuda_reason()
    if reason:
        pytest.fail(f"the gpu suite needs a CUDA device and CUDA torch: {reason}", pytrace=False)
    from trt_diffusion.targets.tensorrt.cudart import cuda_python_reason

    if cuda_python_reason():
        pytest.fail(f"the runner's gpu tests need cuda-python: {cuda_python_reason()}", pytrace=False)


import torch  # noqa: E402

from trt_diffusion.targets.tensorrt.cudart import Cuda  # noqa: E402
from trt_diffusion.targets.tensorrt.manifest import EngineManifest, manifest_path  # noqa: E402
from trt_diffusion.targets.tensorrt.runner import EngineGroup, TensorRTRunner  # noqa: E402
from trt_diffusion.tensors import TensorSpec  # noqa: E402

SHAPE = (2, 4, 64, 64)
ACTIVATION = 1 << 20


class _View:
    def __init__(self, pointer: int, shape):
        self.__cuda_array_interface__ = {"data": (pointer, False), "shape": tuple(shape), "typestr": "<f4",
                                         "version": 3, "strides": None}


def _tensor(pointer: int, shape) -> torch.Tensor:
    return torch.as_tensor(_View(pointer, shape), device="cuda")


class TorchEngine:
    """ICudaEngine/IExecutionContext as far as the runner goes: out = sample * 2 + 1, queued on the given stream
    after a long sleep, so a consumer that does not wait for the stream sees the old values."""

    class Context:
        def __init__(self):
            self.addresses, self.shapes, self.activation = {}, {"sample": SHAPE}, None

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            return self.shapes["sample"]

        def set_tensor_address(self, name, pointer):
            self.addresses[name] = pointer
            return True

        def set_device_memory(self, pointer, size):
            self.activation = (pointer, size)

        def execute_async_v3(self, stream_handle):
            assert self.activation and self.activation[1] >= ACTIVATION
            with torch.cuda.stream(torch.cuda.ExternalStream(stream_handle)):
                torch.cuda._sleep(2_000_000)  # ~1 ms: the work is still queued when the host moves on
                out = _tensor(self.addresses["out"], self.shapes["sample"])
                out.copy_(_tensor(self.addresses["sample"], self.shapes["sample"]))
                out.mul_(2).add_(1)  # in place: nothing allocated while a graph is captured
            return True

    num_io_tensors = 2
    device_memory_size_v2 = ACTIVATION

    def create_execution_context(self, strategy):
        return TorchEngine.Context()

    def get_tensor_name(self, index):
        return ["sample", "out"][index]

    def get_tensor_mode(self, name):
        return "INPUT" if name == "sample" else "OUTPUT"

    def get_tensor_dtype(self, name):
        return SimpleNamespace(name="FLOAT")

    def get_tensor_profile_shape(self, name, index):
        return [SHAPE] * 3


TRT = SimpleNamespace(ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED="user"),
                      TensorIOMode=SimpleNamespace(INPUT="INPUT"))


def runner(tmp_path, name="unet", group=None, cuda_graph=False) -> TensorRTRunner:
    plan = tmp_path / f"{name}.plan"
    plan.write_bytes(b"x")
    EngineManifest(spec_key=name, spec_name=name, tensorrt_version="10.13.0", compute_capability=(9, 0),
                   device_name="gpu", flags={}, profile_shapes={"sample": (SHAPE,) * 3}, onnx_sha256="0" * 64,
                   inputs=(TensorSpec(name="sample", dtype="float32", shape=SHAPE),),
                   outputs=(TensorSpec(name="out", dtype="float32", shape=SHAPE),), plan_bytes=1,
                   build_seconds=0).write(manifest_path(plan))
    loader = lambda path: SimpleNamespace(engine=TorchEngine(), manifest=EngineManifest.read(manifest_path(path)))
    return TensorRTRunner(plan, name=name, group=group or EngineGroup(cuda=Cuda()), cuda_graph=cuda_graph,
                          loader=loader, trt_module=TRT)


def test_device_feeds_and_outputs_are_ordered_with_torchs_stream(tmp_path):
    with runner(tmp_path, cuda_graph=True) as r:
        for seed in range(6):  # eager, capture, replays
            source = torch.randn(SHAPE[0], SHAPE[1], SHAPE[3], SHAPE[2], device="cuda", generator=None)
            torch.cuda._sleep(2_000_000)  # the producer is still running on torch's stream
            source.mul_(1.0 + seed)
            feed = source.transpose(2, 3)  # non-contiguous: .contiguous() queues a copy on torch's stream
            out = r.run({"sample": feed})["out"]
            expected = feed * 2 + 1  # on torch's stream: ordered after the runner's outputs were waited for
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        assert r.stats.graph_launches >= 4


def test_host_feeds_through_pinned_buffers_are_never_overwritten_in_flight(tmp_path):
    with runner(tmp_path) as r:
        rng = np.random.default_rng(0)
        for _ in range(8):
            feeds = {"sample": rng.standard_normal(SHAPE).astype(np.float32)}
            np.testing.assert_allclose(r.run(feeds)["out"], feeds["sample"] * 2 + 1, rtol=0, atol=1e-5)


def test_engines_of_a_group_alternate_in_one_activation_allocation(tmp_path):
    group = EngineGroup(cuda=Cuda())
    with runner(tmp_path, "a", group) as a, runner(tmp_path, "b", group, cuda_graph=True) as b:
        for _ in range(4):
            x = torch.randn(SHAPE, device="cuda")
            torch.testing.assert_close(b.run({"sample": a.run({"sample": x})["out"]})["out"], (x * 2 + 1) * 2 + 1)
        assert group.stats["activation_allocations"] == 1
