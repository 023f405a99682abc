"""Run-time memory decisions for TensorRT engines, as pure functions (no TensorRT, no CUDA).

`runner.py` carries these out; everything here is tested on CPU with concrete numbers:

- I/O buffers are sized once for the largest shape of the engine's profile (exact for static engines), so
  a runner allocates at activation and never again while the shapes stay inside its profile.
- The engines of one pipeline never run at once, so they share one activation allocation: its size is the
  largest `device_memory_size_v2` among them, aligned; it grows (and every context is rebound) only when a
  larger engine joins.
- A CUDA graph is captured only for a static-shape engine whose inputs did not change shape, and only
  while the activation memory and I/O buffers it recorded are the ones in use.
- Loaded engines are bounded in GPU memory: least recently used first out, never one that is running or
  that its owner entered explicitly (`with runner:`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...errors import BuildError

ALIGNMENT = 256  # cudaMalloc returns 256-byte aligned memory; TensorRT asks for at least that
GIB = 1 << 30
MEMORY_ENV = "TRT_DIFFUSION_TENSORRT_MEMORY_GB"  # bound on GPU memory held by loaded engines
DEFAULT_MEMORY_FRACTION = 0.9  # of the device's total memory, when MEMORY_ENV is not set

# bytes per element of the dtype names engine manifests use (config.TRT_DTYPE_NAMES)
ITEMSIZE = {
    "float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0, "uint8": 1.0, "int32": 4.0, "int64": 8.0,
    "bool": 1.0, "float8e4m3": 1.0, "float8e8m0": 1.0, "int4": 0.5, "float4e2m1": 0.5,
}

Shape = tuple[int, ...]


class MemoryBudgetError(BuildError):
    """An engine cannot be loaded within the GPU memory bound."""


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    if nbytes < 0:
        raise ValueError(f"negative size {nbytes}")
    return -(-nbytes // alignment) * alignment


def tensor_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of a dense tensor; every dimension must be known (>= 0)."""
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has an unknown dimension")
    if dtype not in ITEMSIZE:
        raise ValueError(f"no element size known for dtype {dtype!r}")
    return math.ceil(math.prod(shape) * ITEMSIZE[dtype])


@dataclass(frozen=True)
class IOTensor:
    """One engine input or output at the largest shape its profile allows."""

    name: str
    is_input: bool
    dtype: str  # a manifest dtype name
    max_shape: Shape


def buffer_sizes(tensors: Iterable[IOTensor]) -> dict[str, int]:
    """Aligned bytes of the device (and pinned host) buffer of each I/O tensor."""
    return {t.name: align_up(max(tensor_bytes(t.max_shape, t.dtype), 1)) for t in tensors}


def needs_new_buffer(capacity: int | None, required: int) -> bool:
    """True when the buffer held (None: none yet) cannot take `required` bytes."""
    return capacity is None or capacity < required


def max_input_shapes(profile_shapes: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, Shape]:
    """The profile's max shape of every input: what buffers are sized for at activation."""
    return {name: tuple(int(d) for d in shapes[2]) for name, shapes in profile_shapes.items()}


def is_static_profile(profile_shapes: Mapping[str, Sequence[Sequence[int]]]) -> bool:
    """True when every input has one shape (min == opt == max): the engines a CUDA graph can replay."""
    return bool(profile_shapes) and all(
        tuple(shapes[0]) == tuple(shapes[1]) == tuple(shapes[2]) for shapes in profile_shapes.values()
    )


def graph_capture_reason(requested: bool, profile_shapes: Mapping[str, Sequence[Sequence[int]]]) -> str | None:
    """None when the runner should capture a CUDA graph, else why it runs eagerly."""
    if not requested:
        return "CUDA graphs not requested"
    if not is_static_profile(profile_shapes):
        return "the engine has a dynamic-shape profile: a captured graph would replay one shape only"
    return None


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph recorded: the input shapes, the activation generation, the buffer generation."""

    shapes: tuple[tuple[str, Shape], ...]
    activation_generation: int
    buffer_generation: int

    @classmethod
    def of(cls, shapes: Mapping[str, Shape], activation_generation: int, buffer_generation: int) -> GraphKey:
        return cls(tuple(sorted((k, tuple(v)) for k, v in shapes.items())), activation_generation, buffer_generation)


def graph_is_valid(captured: GraphKey | None, now: GraphKey) -> bool:
    """A graph replays only the addresses and shapes it recorded."""
    return captured is not None and captured == now


def shared_activation_bytes(sizes: Mapping[str, int]) -> int:
    """The one activation allocation the engines of a pipeline share: the largest they need, aligned."""
    if any(s < 0 for s in sizes.values()):
        raise ValueError(f"negative activation size in {dict(sizes)}")
    return align_up(max(sizes.values(), default=0))


def memory_bound_bytes(total_bytes: int, override_gb: str | float | None = None,
                       fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """The GPU memory loaded engines may hold: `override_gb` (MEMORY_ENV) or a fraction of the device."""
    if override_gb is None or override_gb == "":
        return int(total_bytes * fraction)
    try:
        gigabytes = float(override_gb)
    except ValueError:
        raise MemoryBudgetError(f"{MEMORY_ENV} must be a number of GiB, got {override_gb!r}") from None
    if not gigabytes > 0:
        raise MemoryBudgetError(f"{MEMORY_ENV} must be positive, got {override_gb!r}")
    return int(gigabytes * GIB)


class EngineBudget:
    """Which loaded engines stay on the GPU: least recently used first out, within `bound_bytes`.

    Pure bookkeeping: `admit` answers which engines to unload before one more is loaded; the caller
    unloads them and calls `release` for each. Pinned engines (running, or entered with `with`) are never
    chosen. The shared activation allocation counts against the bound (`set_shared`).
    """

    def __init__(self, bound_bytes: int):
        self.bound_bytes = int(bound_bytes)
        self.shared_bytes = 0
        self._loaded: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._pinned: dict[str, int] = {}

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    @property
    def used_bytes(self) -> int:
        return self.shared_bytes + sum(self._loaded.values())

    def set_shared(self, nbytes: int) -> None:
        self.shared_bytes = int(nbytes)

    def touch(self, key: str) -> None:
        if key in self._loaded:
            self._loaded.move_to_end(key)

    def pin(self, key: str) -> None:
        self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        count = self._pinned.get(key, 0) - 1
        if count > 0:
            self._pinned[key] = count
        else:
            self._pinned.pop(key, None)

    def admit(self, key: str, nbytes: int, shared_after: int | None = None) -> list[str]:
        """Engines to unload (least recently used first) so that `key` (`nbytes`) fits; records `key` as
        loaded. `shared_after` is the shared activation size once `key` joins. MemoryBudgetError when it
        cannot fit even after every unpinned engine is out."""
        shared = self.shared_bytes if shared_after is None else max(self.shared_bytes, shared_after)
        if key in self._loaded:
            self.touch(key)
            return []
        evict: list[str] = []
        used = shared + sum(self._loaded.values())
        for other, size in self._loaded.items():
            if used + nbytes <= self.bound_bytes:
                break
            if other in self._pinned:
                continue
            evict.append(other)
            used -= size
        if used + nbytes > self.bound_bytes:
            held = ", ".join(f"{k} ({v / GIB:.2f} GiB)" for k, v in self._loaded.items() if k not in evict)
            raise MemoryBudgetError(
                f"engine {key} needs {nbytes / GIB:.2f} GiB; the bound is {self.bound_bytes / GIB:.2f} GiB with "
                f"{shared / GIB:.2f} GiB of shared activation memory and {held or 'nothing else'} held in use. "
                f"Raise {MEMORY_ENV} or use fewer buckets at once")
        for other in evict:
            del self._loaded[other]
        self._loaded[key] = int(nbytes)
        self.shared_bytes = shared
        return evict

    def release(self, key: str) -> None:
        self._loaded.pop(key, None)
        self._pinned.pop(key, None)

    def grow(self, key: str, nbytes: int) -> list[str]:
        """`key` (loaded) holds `nbytes` more (fewer when negative: device-resident refit weights uploaded or
        freed): the engines to unload first, least recently used, never `key` or a pinned one; MemoryBudgetError
        when it cannot fit even then."""
        if key not in self._loaded:
            if nbytes <= 0:  # already unloaded (evicted): nothing of it is counted any more
                return []
            raise KeyError(key)
        if nbytes <= 0:
            self._loaded[key] = max(0, self._loaded[key] + int(nbytes))
            return []
        evict: list[str] = []
        used = self.used_bytes
        for other, size in self._loaded.items():
            if used + nbytes <= self.bound_bytes:
                break
            if other == key or other in self._pinned:
                continue
            evict.append(other)
            used -= size
        if used + nbytes > self.bound_bytes:
            raise MemoryBudgetError(
                f"engine {key} needs {nbytes / GIB:.2f} GiB more for device-resident refit weights; the bound is "
                f"{self.bound_bytes / GIB:.2f} GiB and {used / GIB:.2f} GiB is held in use. Raise {MEMORY_ENV}, keep "
                "fewer LoRA sets resident (resident_lora_sets) or refit from host memory")
        for other in evict:
            del self._loaded[other]
        self._loaded[key] += int(nbytes)
        return evict


# ----------------------------------------------------------------------------------------------
# Device-resident refit weights (LoRA hot swap)
# ----------------------------------------------------------------------------------------------


class ResidentSets:
    """Which LoRA weight sets a runner keeps uploaded on the GPU for `refit_cuda_engine_async`: least recently
    used first out beyond `capacity`, never the set the engine was just refitted with. Pure bookkeeping: the
    runner uploads, refits and frees; this says which digests to free."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"resident LoRA sets must be at least 1, got {capacity}")
        self.capacity = int(capacity)
        self._sets: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recently used first

    def __contains__(self, digest: str) -> bool:
        return digest in self._sets

    @property
    def digests(self) -> list[str]:
        return list(self._sets)

    @property
    def total_bytes(self) -> int:
        return sum(self._sets.values())

    def use(self, digest: str) -> None:
        self._sets.move_to_end(digest)

    def add(self, digest: str, nbytes: int) -> list[str]:
        """Record an uploaded set (the most recently used); the digests to free to stay within `capacity`."""
        self._sets[digest] = int(nbytes)
        self._sets.move_to_end(digest)
        evict = []
        while len(self._sets) > self.capacity:
            oldest = next(iter(self._sets))
            evict.append(oldest)
            del self._sets[oldest]
        return evict

    def clear(self) -> list[str]:
        digests = list(self._sets)
        self._sets.clear()
        return digests


# ----------------------------------------------------------------------------------------------
# Weight streaming (engines built with WEIGHT_STREAMING)
# ----------------------------------------------------------------------------------------------


def weight_streaming_budget(requested_bytes: int | None, streamable_bytes: int | None, built_streaming: bool,
                            engine_name: str) -> int | None:
    """The `weight_streaming_budget_v2` a runner sets before creating its context, or None to leave TensorRT's
    default (every weight resident). `requested_bytes`: how much of the streamable weights may stay on the GPU
    (0 streams the most); at or above the streamable size nothing streams."""
    if requested_bytes is None:
        return None
    if not built_streaming:
        raise MemoryBudgetError(f"engine {engine_name} was not built with weight streaming "
                                "(build option tensorrt_weight_streaming): a weight budget cannot apply")
    if requested_bytes < 0:
        raise MemoryBudgetError(f"engine {engine_name}: a weight streaming budget is >= 0 bytes, got {requested_bytes}")
    return requested_bytes if streamable_bytes is None else min(requested_bytes, streamable_bytes)


def resident_bytes(plan_bytes: int, streamable_bytes: int | None, budget_bytes: int | None) -> int:
    """GPU memory an engine's weights hold once loaded (what admission budgets): the plan, less the streamable
    weights beyond the budget."""
    if budget_bytes is None or not streamable_bytes:
        return plan_bytes
    return max(0, plan_bytes - streamable_bytes + min(budget_bytes, streamable_bytes))


# ----------------------------------------------------------------------------------------------
# Feeds: numpy arrays (host) or torch CUDA tensors (device), described without importing torch
# ----------------------------------------------------------------------------------------------

TORCH_DTYPE_NAMES = {
    "torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.int8": "int8",
    "torch.uint8": "uint8", "torch.int32": "int32", "torch.int64": "int64", "torch.bool": "bool",
    "torch.float8_e4m3fn": "float8e4m3",
}


# manifest dtype name -> torch's name where they differ (torch has no 4-bit dtypes: none for int4/float4e2m1)
TORCH_NAME_OF = {"float8e4m3": "float8_e4m3fn", "float8e8m0": "float8_e8m0fnu"}
NO_TORCH_DTYPE = ("int4", "float4e2m1")


def torch_dtype_name(dtype: str) -> str:
    """The `torch.<name>` of a manifest dtype name (`float8e4m3` is torch's `float8_e4m3fn`); ValueError for the
    packed 4-bit types torch cannot hold."""
    if dtype in NO_TORCH_DTYPE:
        raise ValueError(f"torch has no dtype for {dtype}: an engine output of that type cannot come back as a tensor")
    return TORCH_NAME_OF.get(dtype, dtype)


@dataclass(frozen=True)
class FeedInfo:
    dtype: str
    shape: Shape
    on_device: bool  # a CUDA tensor: copied device to device, never through the host


def is_torch_cuda(value: object) -> bool:
    return type(value).__module__.startswith("torch") and bool(getattr(value, "is_cuda", False))


def describe_feed(value: object) -> FeedInfo:
    """dtype name, shape and placement of a numpy array or a torch tensor."""
    dtype = getattr(value, "dtype", None)
    shape = tuple(int(d) for d in getattr(value, "shape", ()))
    if type(value).__module__.startswith("torch"):
        name = TORCH_DTYPE_NAMES.get(str(dtype), str(dtype))
        return FeedInfo(name, shape, is_torch_cuda(value))
    import numpy as np

    return FeedInfo(np.dtype(dtype).name, shape, False)


def outputs_on_device(feeds: Mapping[str, object]) -> bool:
    """Outputs come back as torch CUDA tensors exactly when some input was one (the pipeline's device
    path); numpy in, numpy out."""
    return any(is_torch_cuda(v) for v in feeds.values())
