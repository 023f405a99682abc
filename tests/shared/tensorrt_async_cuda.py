"""An asynchronous fake CUDA runtime for the TensorRT runner's CPU tests (#27 item 3).

`tensorrt_stub_fake.FakeCudart` runs every copy and kernel the moment it is enqueued, so no ordering bug can
show. Here, as on a GPU, work queued on a stream runs later: only when something waits for it.

- Every stream is a queue. `cudaMemcpyAsync`, `execute_async_v3` (through the fake TensorRT's capture hook) and
  `cudaGraphLaunch` append to it; host memory is read and written when the copy *runs*, not when it is queued.
- `cudaEventRecord(event, s)` marks the position of `s`'s queue at that moment; `cudaStreamWaitEvent(w, event)`
  makes everything queued on `w` afterwards wait until `s` has run up to that mark (real event semantics: work
  queued on `s` after the record is not covered).
- `cudaStreamSynchronize(s)` runs `s` to its end, running other streams only as far as `s`'s waits require.
  Streams otherwise do not advance: the most adversarial schedule the CUDA rules allow for the synchronizing
  stream, so a missing wait shows as stale data.
- memory freed while queued work still uses it fails that work when it runs (the fake's reads and writes
  refuse addresses that are not allocated).
- `fail_malloc(n)` makes the next `n` cudaMalloc calls fail with cudaErrorMemoryAllocation.
- `external_stream(label)` is a stream the runner did not create (torch's current stream).
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from tensorrt_stub_fake import FakeCudart, _Handle


class _Sink:
    """What the fake TensorRT appends `execute_async_v3`'s work to: the stream's queue, or a capture."""

    def __init__(self, cuda: AsyncCudart, stream: int):
        self.cuda, self.stream = cuda, stream

    def append(self, work: Callable[[], None]) -> None:
        self.cuda.enqueue(self.stream, "execute", work)


class _Capturing(dict):
    def __init__(self, cuda: AsyncCudart):
        super().__init__()
        self.cuda = cuda

    def get(self, stream, default=None):  # the fake TensorRT asks this for every execute_async_v3
        captured = dict.get(self, stream)
        return captured if captured is not None else _Sink(self.cuda, stream)

    def __getitem__(self, stream):
        return self.get(stream)


class AsyncCudart(FakeCudart):
    def __init__(self, total_bytes: int = 8 << 30):
        super().__init__(total_bytes)
        self.capturing = _Capturing(self)
        self.queues: dict[int, list[tuple[str, Any]]] = defaultdict(list)  # stream -> every item ever queued
        self.done: dict[int, int] = defaultdict(int)  # stream -> items run so far
        self.marks: dict[int, tuple[int, int]] = {}  # event -> (stream, position)
        self.ran: list[tuple[int, str]] = []  # (stream, label) in the order they ran
        self._malloc_failures = 0

    # ------------------------------------------------------------------ test controls

    def fail_malloc(self, count: int = 1) -> None:
        self._malloc_failures = count

    def external_stream(self) -> int:
        handle = self._new()
        self.streams.add(handle)
        return handle

    def enqueue(self, stream: Any, label: str, work: Callable[[], None]) -> None:
        self.queues[int(stream)].append((label, work))

    def pending(self, stream: Any) -> int:
        return len(self.queues[int(stream)]) - self.done[int(stream)]

    def run_stream(self, stream: Any, upto: int | None = None) -> None:
        stream = int(stream)
        end = len(self.queues[stream]) if upto is None else upto
        while self.done[stream] < end:
            label, item = self.queues[stream][self.done[stream]]
            if label == "wait":
                other, position = item
                self.run_stream(other, position)
            else:
                item()
                self.ran.append((stream, label))
            self.done[stream] += 1

    def drain(self) -> None:
        for stream in list(self.queues):
            self.run_stream(stream)

    # ------------------------------------------------------------------ the runtime calls, asynchronous

    def cudaMalloc(self, size):
        if self._malloc_failures:
            self._malloc_failures -= 1
            self._count("cudaMalloc")
            return (self.cudaError_t.cudaErrorMemoryAllocation, None)
        return super().cudaMalloc(size)

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        self._count(f"cudaMemcpyAsync({kind})")

        def copy():
            if kind == "HtoD":
                self.write(dst, np.frombuffer(ctypes.string_at(src, count), np.uint8))
            elif kind == "DtoH":
                ctypes.memmove(dst, bytes(self.read(src, np.uint8, (count,))), count)
            else:
                self.write(dst, self.read(src, np.uint8, (count,)))

        self.enqueue(stream, f"copy {kind}", copy)
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamSynchronize(self, stream):
        self._count("cudaStreamSynchronize")
        self.run_stream(stream)
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamDestroy(self, stream):
        self.run_stream(stream)  # CUDA finishes a destroyed stream's work
        return super().cudaStreamDestroy(stream)

    def cudaEventRecord(self, event, stream):
        self._count("cudaEventRecord")
        self.marks[int(event)] = (int(stream), len(self.queues[int(stream)]))
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        self._count("cudaStreamWaitEvent")
        self.queues[int(stream)].append(("wait", self.marks[int(event)]))
        return (self.cudaError_t.cudaSuccess,)

    def cudaGraphLaunch(self, graphExec, stream):
        self._count("cudaGraphLaunch")
        works = list(graphExec[1])

        def launch():
            for work in works:
                work()

        self.enqueue(stream, "graph", launch)
        return (self.cudaError_t.cudaSuccess,)


class FakeDtype:
    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


class FakeCudaTensor:
    """What the runner reads of a torch CUDA tensor: dtype, shape, is_cuda, data_ptr(), contiguous()."""

    __module__ = "torch.fake"  # describe_feed tells torch tensors by their type's module
    is_cuda = True

    def __init__(self, cuda: AsyncCudart, pointer: int, shape: tuple[int, ...], dtype: str = "float32",
                 contiguous: bool = True, torch_stream: int | None = None):
        self.cuda, self.pointer, self.shape, self.dtype = cuda, pointer, tuple(shape), FakeDtype(dtype)
        self.is_contiguous, self.torch_stream = contiguous, torch_stream

    @classmethod
    def produced(cls, cuda: AsyncCudart, torch_stream: int, array: np.ndarray, *, contiguous: bool = True):
        """A tensor whose values a kernel on torch's stream writes (queued, not yet run)."""
        pointer = cuda.cudaMalloc(array.nbytes)[1]
        cuda.enqueue(torch_stream, "torch kernel", lambda: cuda.write(pointer, np.ascontiguousarray(array)))
        return cls(cuda, pointer, array.shape, array.dtype.name, contiguous, torch_stream)

    def data_ptr(self) -> int:
        return self.pointer

    def contiguous(self) -> FakeCudaTensor:
        """torch queues a copy kernel on its current stream for a non-contiguous tensor, as the real one does."""
        if self.is_contiguous:
            return self
        nbytes = int(np.prod(self.shape)) * np.dtype(self.dtype.name).itemsize
        pointer = self.cuda.cudaMalloc(nbytes)[1]
        source = self.pointer
        self.cuda.enqueue(self.torch_stream, "torch contiguous copy",
                          lambda: self.cuda.write(pointer, self.cuda.read(source, np.uint8, (nbytes,))))
        return FakeCudaTensor(self.cuda, pointer, self.shape, self.dtype.name, True, self.torch_stream)

    def numpy_after(self, stream: int) -> np.ndarray:
        """The values once `stream` (torch's) has run to its end: what a consumer of the output sees."""
        self.cuda.run_stream(stream)
        return self.cuda.read(self.pointer, np.dtype(self.dtype.name) if self.dtype.name != "float8_e4m3fn"
                              else np.uint8, self.shape)


_ = _Handle  # re-exported for tests that make handles
