"""The CUDA runtime calls the TensorRT runner makes, through cuda-python's `cuda.bindings.runtime`.

The only importer of cuda-python in trt-diffusion (imported on first use, so this module imports without
it). Every call checks its error code and raises `CudaError` naming the call. Streams, events and graphs
are passed around as cuda-python's own handle objects; `stream_handle` gives the integer TensorRT's
`execute_async_v3` takes. A CPU test reads this file and checks every `self._rt.<name>` it calls exists in
the real cuda-python (when installed), so a misspelled CUDA call cannot hide until a GPU host runs it.
"""

from __future__ import annotations

import ctypes
import importlib
from typing import Any

import numpy as np

from ...errors import InternalError, MissingDependencyError

CUDA_HINT = ("the TensorRT runner needs cuda-python (cuda.bindings): "
             "pip install 'trt-diffusion[tensorrt]' --extra-index-url https://pypi.nvidia.com")


class CudaError(InternalError):
    """A CUDA runtime call failed: a bug or a broken driver, not the user's to fix (the CLI exits 3). The one failure
    a user can act on, an allocation the GPU has no room for, is `CudaOutOfMemory`, which the runner turns into a
    ServeError naming the engine and the bytes."""


class CudaOutOfMemory(CudaError):
    """cudaMalloc/cudaMallocHost of `nbytes` failed for lack of memory."""

    def __init__(self, message: str, nbytes: int):
        super().__init__(message)
        self.nbytes = nbytes


OUT_OF_MEMORY = "cudaErrorMemoryAllocation"


def import_cudart() -> Any:
    """cuda-python's runtime module (cuda.bindings.runtime; cuda.cudart before 12.6)."""
    for name in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise MissingDependencyError(f"cuda-python is not installed; {CUDA_HINT}")


def cuda_python_reason() -> str | None:
    """None when cuda-python imports, else why not."""
    try:
        import_cudart()
    except MissingDependencyError as err:
        return str(err)
    return None


def host_array(pointer: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of `nbytes` of host memory at `pointer` (pinned staging buffers), as `dtype[shape]`."""
    raw = (ctypes.c_byte * nbytes).from_address(pointer)
    count = int(np.prod(shape)) if shape else 1
    return np.frombuffer(memoryview(raw), dtype=dtype, count=count).reshape(shape)


class Cuda:
    """The runtime calls the runner needs, each checked. One instance per process is enough."""

    def __init__(self, runtime: Any = None):
        self._rt = runtime if runtime is not None else import_cudart()

    def _check(self, result: Any, call: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._rt.cudaError_t.cudaSuccess:
            name = getattr(err, "name", str(err))
            raise CudaError(f"CUDA call {call} failed: {name}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    # devices
    def set_device(self, index: int) -> None:
        """Make GPU `index` (as CUDA numbers them, after CUDA_VISIBLE_DEVICES) this thread's current device."""
        self._check(self._rt.cudaSetDevice(index), "cudaSetDevice")

    # memory
    def _allocated(self, result: Any, call: str, nbytes: int) -> int:
        try:
            return int(self._check(result, call))
        except CudaError as err:
            if OUT_OF_MEMORY in str(err):
                raise CudaOutOfMemory(f"{err} ({nbytes} bytes)", nbytes) from None
            raise

    def malloc(self, nbytes: int) -> int:
        return self._allocated(self._rt.cudaMalloc(nbytes), "cudaMalloc", nbytes)

    def free(self, pointer: int) -> None:
        self._check(self._rt.cudaFree(pointer), "cudaFree")

    def malloc_host(self, nbytes: int) -> int:
        """Page-locked host memory: asynchronous copies from it do not stage through a pageable buffer."""
        return self._allocated(self._rt.cudaMallocHost(nbytes), "cudaMallocHost", nbytes)

    def free_host(self, pointer: int) -> None:
        self._check(self._rt.cudaFreeHost(pointer), "cudaFreeHost")

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._check(self._rt.cudaMemGetInfo(), "cudaMemGetInfo")
        return int(free), int(total)

    # copies, all asynchronous on `stream`
    def copy_to_device(self, device: int, host: int, nbytes: int, stream: Any) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._check(self._rt.cudaMemcpyAsync(device, host, nbytes, kind, stream), "cudaMemcpyAsync(HtoD)")

    def copy_to_host(self, host: int, device: int, nbytes: int, stream: Any) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._check(self._rt.cudaMemcpyAsync(host, device, nbytes, kind, stream), "cudaMemcpyAsync(DtoH)")

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._check(self._rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync(DtoD)")

    # streams and events
    def stream_create(self) -> Any:
        """A non-blocking stream: it does not synchronise with the legacy default stream, and can be captured."""
        return self._check(self._rt.cudaStreamCreateWithFlags(self._rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")

    def stream_destroy(self, stream: Any) -> None:
        self._check(self._rt.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def synchronize(self, stream: Any) -> None:
        self._check(self._rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    @staticmethod
    def stream_handle(stream: Any) -> int:
        return int(stream)

    def event_create(self) -> Any:
        return self._check(self._rt.cudaEventCreateWithFlags(self._rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")

    def event_destroy(self, event: Any) -> None:
        self._check(self._rt.cudaEventDestroy(event), "cudaEventDestroy")

    def wait(self, waiter: Any, signaller: Any, event: Any) -> None:
        """`waiter` runs nothing more until the work queued on `signaller` so far is done (no host sync)."""
        self._check(self._rt.cudaEventRecord(event, signaller), "cudaEventRecord")
        self._check(self._rt.cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent")

    # CUDA graphs
    def begin_capture(self, stream: Any) -> None:
        mode = self._rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        self._check(self._rt.cudaStreamBeginCapture(stream, mode), "cudaStreamBeginCapture")

    def end_capture(self, stream: Any) -> Any:
        """The captured graph, instantiated (the graph itself is destroyed once instantiated)."""
        graph = self._check(self._rt.cudaStreamEndCapture(stream), "cudaStreamEndCapture")
        try:
            return self._check(self._rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        finally:
            self._check(self._rt.cudaGraphDestroy(graph), "cudaGraphDestroy")

    def abort_capture(self, stream: Any) -> None:
        """End a capture that failed half way, dropping what it recorded."""
        try:
            result = self._rt.cudaStreamEndCapture(stream)
        except Exception:  # noqa: BLE001 - already failing; the first error is the one reported
            return
        if isinstance(result, tuple) and len(result) > 1 and result[1] is not None:
            self._rt.cudaGraphDestroy(result[1])

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self._check(self._rt.cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch")

    def graph_destroy(self, graph_exec: Any) -> None:
        self._check(self._rt.cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy")
