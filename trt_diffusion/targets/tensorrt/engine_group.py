"""The engines of one pipeline on one GPU: one CUDA stream, one shared activation allocation, one bound on the GPU
memory loaded engines hold (least recently used lazily loaded engines unloaded first), one lock so two of them
never run at once. The runners (runner.py) join and leave it; every size and eviction is a pure decision of
device_memory.py."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

from .cudart import Cuda, CudaError
from .device_memory import MEMORY_ENV, EngineBudget, memory_bound_bytes, shared_activation_bytes

if TYPE_CHECKING:
    import tensorrt as trt

    from .runner import TensorRTRunner


class EngineGroup:
    """The engines of one pipeline on one GPU: one stream, one shared activation allocation, one bound on
    the GPU memory loaded engines hold, one lock (so two of them never run at once)."""

    def __init__(self, *, cuda: Cuda | None = None, bound_bytes: int | None = None, device: int | None = None):
        self.lock = threading.RLock()
        # the GPU this group's engines live on (a Triton instance group on GPU N); None: the thread's current one
        self.device = device
        self._cuda = cuda
        self._bound_bytes = bound_bytes
        self.stream: Any = None
        self.budget: EngineBudget | None = None
        self.activation_pointer = 0
        self.activation_bytes = 0
        self.activation_generation = 0
        self._needs: dict[str, int] = {}  # member key -> activation bytes it needs
        self._members: dict[str, TensorRTRunner] = {}
        self._event: Any = None
        self.stats: Counter[str] = Counter()

    @property
    def cuda(self) -> Cuda:
        if self._cuda is None:
            self._cuda = Cuda()
        return self._cuda

    def use_device(self) -> None:
        """Make the group's GPU current in the calling thread: CUDA's current device is per thread, and a runner
        is called from whichever thread serves a request."""
        if self.device is not None:
            self.cuda.set_device(self.device)

    def _open(self) -> EngineBudget:
        self.use_device()
        if self.budget is None:
            if self._bound_bytes is None:
                _, total = self.cuda.mem_get_info()
                self._bound_bytes = memory_bound_bytes(total, os.environ.get(MEMORY_ENV))
            self.budget = EngineBudget(self._bound_bytes)
        if self.stream is None:
            self.stream = self.cuda.stream_create()
            self.stats["streams_created"] += 1
        return self.budget

    def event(self) -> Any:
        if self._event is None:
            self._event = self.cuda.event_create()
        return self._event

    @property
    def members(self) -> list[str]:
        return list(self._members)

    def admit(self, runner: TensorRTRunner, resident_bytes: int, activation_bytes: int | None = None) -> None:
        """Make room for `runner` (unloading least recently used lazily loaded engines) before it loads.
        `activation_bytes` (its manifest's `device_memory_bytes`) is what it adds to the shared activation
        allocation: budgeted now, before the load, not discovered after it."""
        budget = self._open()
        needs = {**self._needs, runner.key: activation_bytes} if activation_bytes is not None else None
        shared_after = shared_activation_bytes(needs) if needs is not None else None
        evict = budget.admit(runner.key, resident_bytes, shared_after=shared_after)
        self._members[runner.key] = runner  # first, so the group stays open while others leave
        for key in evict:
            self._members[key].deactivate()

    def bind_activation(self, runner: TensorRTRunner, context: trt.IExecutionContext, needed: int) -> None:
        """Give `context` the shared activation memory, growing it (and rebinding every member) when
        `needed` is more than it holds.

        The new allocation is made before the old one is freed, so a failed cudaMalloc leaves every member
        bound to memory that is still allocated. Where both do not fit at once, the old one is freed first:
        then every member is unbound and the generation bumped before the second try, so no context and no
        captured graph is left pointing at freed memory whatever that try gives."""
        self._needs[runner.key] = needed
        size = shared_activation_bytes(self._needs)
        if size > self.activation_bytes:
            self.cuda.synchronize(self.stream)  # nothing may still run in the old allocation
            try:
                pointer = self.cuda.malloc(size)
            except CudaError:
                if not self.activation_pointer:
                    self._needs.pop(runner.key, None)
                    raise
                held = self.activation_bytes
                self._release_activation()  # not both at once: free first, nothing left bound to it
                try:
                    pointer = self.cuda.malloc(size)
                except CudaError:
                    self._needs.pop(runner.key, None)
                    self._restore_activation(held)  # the members that fitted get memory again, then the error
                    raise
            if self.activation_pointer:
                self._release_activation()
            self.activation_pointer, self.activation_bytes = pointer, size
            self.activation_generation += 1
            self.stats["activation_allocations"] += 1
            for key, member in self._members.items():
                if key != runner.key and member.context is not None:
                    member.context.set_device_memory(self.activation_pointer, self.activation_bytes)
                    member.bound_generation = self.activation_generation
        if self.budget is not None:
            self.budget.set_shared(self.activation_bytes)
        context.set_device_memory(self.activation_pointer, self.activation_bytes)
        runner.bound_generation = self.activation_generation

    def _restore_activation(self, nbytes: int) -> None:
        """After a failed growth: an allocation of the size the earlier members fitted in, every one rebound (a new
        generation: their graphs recapture). Left unbound when even that fails; they rebind before running."""
        try:
            self.activation_pointer = self.cuda.malloc(nbytes)
        except CudaError:
            return
        self.activation_bytes = nbytes
        self.activation_generation += 1
        for member in self._members.values():
            if member.context is not None and member.key in self._needs:
                member.context.set_device_memory(self.activation_pointer, self.activation_bytes)
                member.bound_generation = self.activation_generation

    def _release_activation(self) -> None:
        """Free the shared allocation; the generation moves on, so no member runs or replays into it unbound."""
        self.cuda.free(self.activation_pointer)
        self.stats["activation_frees"] += 1
        self.activation_pointer, self.activation_bytes = 0, 0
        self.activation_generation += 1
        for member in self._members.values():
            member.bound_generation = -1

    def grow(self, runner: TensorRTRunner, nbytes: int) -> None:
        """`runner` holds `nbytes` more GPU memory (device-resident refit weights; fewer when negative): least
        recently used lazily loaded engines are unloaded first where the bound needs it."""
        if self.budget is None:
            return
        for key in self.budget.grow(runner.key, nbytes):
            self._members[key].deactivate()

    def leave(self, runner: TensorRTRunner) -> None:
        self._members.pop(runner.key, None)
        self._needs.pop(runner.key, None)
        if self.budget is not None:
            self.budget.release(runner.key)
        if not self._members:
            self.close()

    def close(self) -> None:
        """Free the shared allocation, the event and the stream once no engine is loaded."""
        for member in list(self._members.values()):
            member.deactivate()
        if self.stream is not None:
            self.cuda.synchronize(self.stream)
        if self.activation_pointer:
            self.cuda.free(self.activation_pointer)
            self.stats["activation_frees"] += 1
        self.activation_pointer, self.activation_bytes = 0, 0
        self._needs.clear()
        if self._event is not None:
            self.cuda.event_destroy(self._event)
            self._event = None
        if self.stream is not None:
            self.cuda.stream_destroy(self.stream)
            self.stream = None
        if self.budget is not None:
            self.budget.set_shared(0)


_DEFAULT_GROUPS: dict[int | None, EngineGroup] = {}
_DEFAULT_LOCK = threading.Lock()


def default_group(device: int | None = None) -> EngineGroup:
    """The process's group for a GPU: the runners a target hands out for one pipeline on one GPU share it."""
    with _DEFAULT_LOCK:
        if device not in _DEFAULT_GROUPS:
            _DEFAULT_GROUPS[device] = EngineGroup(device=device)
        return _DEFAULT_GROUPS[device]
