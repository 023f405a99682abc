"""The production runner over one TensorRT plan (the group the engines of one pipeline share: engine_group.py).

As NVIDIA's demo/Diffusion and the TensorRT developer guide run engines: one execution context per loaded
engine, created once; device and pinned host buffers allocated once at the profile's largest shapes and
kept between calls; asynchronous copies and `execute_async_v3` on one CUDA stream; an optional CUDA graph
replayed for static-shape engines; and one activation allocation shared by all engines of a pipeline (they
never run at once: the group's lock makes sure). torch CUDA tensors are taken and given back on the device.

Lifecycle (DESIGN.md's house rule): `TensorRTRunner(...)` reads only the manifest; `with runner:` loads the
engine and allocates; `run` outside a `with` loads lazily, and such engines are unloaded least recently
used first when the group's GPU memory bound would be passed. Every decision (sizes, when to capture, what
to unload) is a pure function of `device_memory.py`; this module only carries them out.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import RuntimeInputError, ServeError
from ...tensors import TensorSpec, is_fixed
from ..runner_base import ROUTED_PROFILE, BaseRunner
from . import engine_group
from .cudart import CudaOutOfMemory, host_array
from .device_memory import (
    MEMORY_ENV,
    GraphKey,
    IOTensor,
    ResidentSets,
    Shape,
    buffer_sizes,
    describe_feed,
    graph_capture_reason,
    graph_is_valid,
    max_input_shapes,
    needs_new_buffer,
    outputs_on_device,
    resident_bytes,
    tensor_bytes,
    torch_dtype_name,
    weight_streaming_budget,
)
from .dtypes import numpy_dtype_for
from .engine_group import EngineGroup
from .feeds import check_feeds
from .layout import select_profile
from .manifest import EngineManifest, manifest_path

if TYPE_CHECKING:
    import tensorrt as trt

    from .plan_load import TensorRTEngine
    from .refit import DeviceWeights

Loader = Callable[[Path], "TensorRTEngine"]
CUDA_GRAPH_ENV = "TRT_DIFFUSION_TENSORRT_CUDA_GRAPH"  # 1: runners the target hands out replay CUDA graphs


def _dims(dims: trt.Dims) -> Shape:
    return tuple(int(dims[i]) for i in range(len(dims)))


@dataclass
class _Buffer:
    tensor: IOTensor
    capacity: int
    device: int
    host: int


@dataclass
class RunnerStats:
    """What the runner allocated and how it ran: the gpu suite and the CPU tests assert on these."""

    activations: int = 0
    contexts_created: int = 0
    device_allocations: int = 0
    host_allocations: int = 0
    graph_captures: int = 0
    graph_launches: int = 0
    eager_runs: int = 0
    runs: int = 0
    graph_skip_reason: str | None = None
    extra: Counter[str] = field(default_factory=Counter)


class _FeedView:
    """What feeds.check_feeds reads of a feed (dtype, shape) for numpy arrays and torch tensors alike."""

    def __init__(self, value: object):
        info = describe_feed(value)
        self.dtype: Any = numpy_dtype_for(info.dtype) or info.dtype
        self.shape = info.shape


class TensorRTRunner(BaseRunner):
    """One TensorRT engine, run as BaseRunner's lifecycle. Inputs are checked against the manifest (names, dtypes,
    the profile's shape ranges) before anything reaches TensorRT; every step holds the group's lock."""

    device_tensors = True  # takes torch CUDA tensors and gives them back without host copies

    def __init__(self, plan_path: str | Path, *, name: str | None = None, group: EngineGroup | None = None,
                 cuda_graph: bool | None = None, loader: Loader | None = None, trt_module: Any = None,
                 weight_budget_bytes: int | None = None, device: int | None = None, resident_lora_sets: int = 4):
        self.path = Path(plan_path)
        self.name = name or self.path.name
        self.key = f"{self.name}@{self.path}"
        self._read_manifest()
        # None: as CUDA_GRAPH_ENV says (off by default); captured only for static-shape engines in any case
        self.cuda_graph = cuda_graph if cuda_graph is not None else os.environ.get(CUDA_GRAPH_ENV, "") in ("1", "true")
        self.stats = RunnerStats()
        # weight streaming: how many bytes of the streamable weights stay on the GPU (None: all of them)
        self.weight_budget_bytes = weight_budget_bytes
        if group is not None and device is not None and group.device != device:
            raise RuntimeInputError(f"{self.name}: its group is on GPU {group.device}, not GPU {device}")
        self._device = device
        self._group = group
        self._loader = loader
        self._trt = trt_module
        self.engine: TensorRTEngine | None = None
        self.context: trt.IExecutionContext | None = None
        self._buffers: dict[str, _Buffer] = {}
        self._shapes: dict[str, Shape] = {}
        self._output_shapes: dict[str, Shape] = {}
        self._buffer_generation = 0
        self._graph: Any = None
        self._graph_key: GraphKey | None = None
        self._warm_key: GraphKey | None = None
        self._pending = False  # work queued on the stream that reads the pinned buffers
        self._entered = 0
        self.bound_generation = -1  # the group's activation generation this context is bound to
        self._profile = 0  # the context's optimization profile
        self._refit_pinned = False
        self._activation_need = 0
        # LoRA hot swap from device memory: the weight sets uploaded (by digest), LRU beyond `resident_lora_sets`,
        # and the base values of the weights they change (to restore them); all freed when the engine unloads
        self._resident = ResidentSets(resident_lora_sets)
        self._resident_sets: dict[str, dict[str, DeviceWeights]] = {}
        self._resident_base: dict[str, DeviceWeights] = {}
        # LoRA per request (serve_loras): the base values of every weight a served set changes; the set each run
        # asks for (None: the base) and the set the engine holds now (its digest; None: the base)
        self._lora_base: dict[str, np.ndarray] | None = None
        self._wanted_set: tuple[str, Mapping[str, np.ndarray]] | None = None
        self._applied_set: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def _read_manifest(self) -> None:
        self.manifest = EngineManifest.read(manifest_path(self.path))
        self._disk_manifest = self.manifest  # as on disk; `manifest` also records in-process refits
        self._manifest_stat = _stat_key(manifest_path(self.path))
        self.inputs = {t.name: TensorSpec((numpy_dtype_for(t.dtype) or np.dtype(np.float32)).name,
                                          tuple(d if is_fixed(d) else None for d in t.shape))
                       for t in self.manifest.inputs}
        self.output_names = [t.name for t in self.manifest.outputs]

    def _refuse_if_changed_on_disk(self, seen: EngineManifest | None = None) -> None:
        """A plan refitted (or rebuilt) on disk since this runner read its manifest is never run silently: the
        runner keeps running what it describes, or refuses; `reload()` takes the new plan explicitly. One stat
        per call; the manifest is read again only when the file changed."""
        if seen is None:
            stat = _stat_key(manifest_path(self.path))
            if stat == self._manifest_stat:
                return
            seen = EngineManifest.read(manifest_path(self.path))
            self._manifest_stat = stat
        if (seen.plan_sha256, seen.refit) != (self._disk_manifest.plan_sha256, self._disk_manifest.refit):
            self._manifest_stat = None  # keep refusing until reload()
            what = (f"LoRA weights {seen.refit.weights_sha256[:12]}…" if seen.refit and not seen.refit.in_progress
                    else "a refit in progress" if seen.refit else "its base weights")
            raise RuntimeInputError(
                f"{self.name}: the engine plan {self.path} was refitted on disk since this runner read it (it now "
                f"holds {what}); call runner.reload() to run the new plan, or keep a runner per LoRA")

    def reload(self) -> None:
        """Take the plan and manifest as they are on disk now (after a refit): unload, re-read, load on next use.
        An in-process refit is dropped with the unload."""
        with self.group.lock:
            self.deactivate()
            self._read_manifest()

    @property
    def group(self) -> EngineGroup:
        if self._group is None:
            self._group = engine_group.default_group(self._device)
        return self._group

    @property
    def active(self) -> bool:
        return self.context is not None  # the group may unload a lazily loaded engine (deactivate) to make room

    def __enter__(self) -> TensorRTRunner:
        """BaseRunner's `with`, counted (blocks may nest) and pinned: an engine entered is never unloaded."""
        with self.group.lock:
            self.activate()
            self._entered += 1
            assert self.group.budget is not None
            self.group.budget.pin(self.key)
        return self

    def __exit__(self, *exc: object) -> None:
        with self.group.lock:
            self._entered -= 1
            if self.group.budget is not None:
                self.group.budget.unpin(self.key)
            if self._entered == 0:
                self.deactivate()

    def _trt_mod(self) -> Any:
        if self._trt is None:
            from .host_probe import require_tensorrt

            self._trt = require_tensorrt()
        return self._trt

    def activate(self) -> None:
        """Load the engine, create its context, bind the shared activation memory, allocate the buffers (under
        the group's lock, on its GPU); an active runner is only marked recently used."""
        group = self.group
        with group.lock:
            group.use_device()
            if self.active:
                if group.budget is not None:
                    group.budget.touch(self.key)
                return
            with self._gpu_memory():
                super().activate()

    @contextlib.contextmanager
    def _gpu_memory(self) -> Iterator[None]:
        """An allocation the GPU has no room for is the user's to act on: a ServeError naming the engine and the bytes
        (every other CUDA failure stays a CudaError: internal, exit 3)."""
        try:
            yield
        except CudaOutOfMemory as err:
            raise ServeError(
                f"{self.name}: the GPU has no room for {err.nbytes} more bytes ({err.nbytes / (1 << 30):.2f} GiB; "
                f"{err}): free GPU memory, load fewer engines at once, lower {MEMORY_ENV} or a weight budget "
                "(serving: tensorrt_weight_budget_gb), or use a larger GPU") from None

    def _activate(self) -> None:
        group = self.group
        trt_mod = self._trt_mod()
        streamable = self.manifest.streamable_weights_bytes
        budget = weight_streaming_budget(self.weight_budget_bytes, streamable,
                                         bool(self.manifest.flags.get("weight_streaming")), self.name)
        # a stripped plan's weights come from its ONNX at load: counted as they are on the GPU, not as its file
        group.admit(self, resident_bytes(self.manifest.device_weights_bytes, streamable, budget),
                    self.manifest.device_memory_bytes)
        try:
            if self._loader is None:
                import functools

                from .plan_load import load_engine

                # the compatibility check reads the group's GPU (hosts may mix GPU architectures)
                self._loader = functools.partial(load_engine, device=group.device or 0)
            self.engine = self._loader(self.path)
            self._refuse_if_changed_on_disk(self.engine.manifest)
            if self.manifest.refit != self._disk_manifest.refit:  # an in-process refit is not on disk
                raise RuntimeInputError(f"{self.name}: the engine was unloaded after an in-process refit and the "
                                        "plan on disk does not hold those weights: refit it again, or reload()")
            engine: trt.ICudaEngine = self.engine.engine
            if budget is not None:  # before the context: its scratch memory depends on the budget
                engine.weight_streaming_budget_v2 = budget
            context = engine.create_execution_context(trt_mod.ExecutionContextAllocationStrategy.USER_MANAGED)
            if context is None:
                raise RuntimeInputError(f"{self.name}: TensorRT could not create an execution context "
                                        "(out of GPU memory?)")
            self.context = context
            self.stats.contexts_created += 1
            self._activation_need = int(engine.device_memory_size_v2)
            group.bind_activation(self, context, self._activation_need)
            self._allocate(self._io_tensors(trt_mod, engine, context))
            # the outputs at the shapes now set (a multi-profile engine's buffers are sized for another one)
            self._output_shapes = {n: _dims(context.get_tensor_shape(n)) for n in self.output_names}
            self.stats.activations += 1
            self.stats.graph_skip_reason = graph_capture_reason(self.cuda_graph, self.manifest.profile_shapes)
        except BaseException:
            self.deactivate()
            raise

    def _io_tensors(self, trt_mod: Any, engine: trt.ICudaEngine, context: trt.IExecutionContext) -> list[IOTensor]:
        """Every I/O tensor at its largest shape: inputs from the profile, outputs as TensorRT infers
        them with every input at its largest shape. A multi-profile engine (engine_layout: profiles): each
        profile in turn at its largest shapes, every buffer sized for the largest of them; profile 0 stays set."""
        from .dtypes import trt_dtype_name

        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt_mod.TensorIOMode.INPUT]
        profiles = list(self.manifest.profiles or [self.manifest.profile_shapes])
        dtypes = {name: trt_dtype_name(engine.get_tensor_dtype(name)) for name in names}
        biggest: dict[str, Shape] = {}
        for index in reversed(range(len(profiles))):  # profile 0 last: the one left active
            if len(profiles) > 1:
                self._select_profile(context, index)
            largest = max_input_shapes(profiles[index])
            for name in inputs:
                if name not in largest:
                    largest[name] = _dims(engine.get_tensor_profile_shape(name, index)[2])
                self._set_shape(context, name, largest[name])
            for name in names:
                shape = largest[name] if name in inputs else _dims(context.get_tensor_shape(name))
                if name not in biggest or tensor_bytes(shape, dtypes[name]) > tensor_bytes(biggest[name], dtypes[name]):
                    biggest[name] = shape
        return [IOTensor(name, name in inputs, dtypes[name], biggest[name]) for name in names]

    def _select_profile(self, context: trt.IExecutionContext, index: int) -> None:
        """Make optimization profile `index` the context's (queued on the group's stream); every input shape must
        then be set again."""
        try:  # the bindings raise where the C++ call returns false (pyCore.cpp); older ones returned False
            accepted = context.set_optimization_profile_async(index, self.group.cuda.stream_handle(self.group.stream))
        except (RuntimeError, ValueError, TypeError) as err:
            raise RuntimeInputError(f"{self.name}: TensorRT refused optimization profile {index} ({err})") from None
        if not accepted:
            raise RuntimeInputError(f"{self.name}: TensorRT refused optimization profile {index}")
        self._profile = index
        self._shapes.clear()

    def _set_shape(self, context: trt.IExecutionContext, name: str, shape: Shape) -> None:
        if not context.set_input_shape(name, shape):
            raise RuntimeInputError(f"{self.name}: TensorRT refused shape {shape} for input {name}")
        self._shapes[name] = shape

    def _allocate(self, tensors: list[IOTensor]) -> None:
        cuda = self.group.cuda
        assert self.context is not None
        for tensor, size in zip(tensors, buffer_sizes(tensors).values()):
            old = self._buffers.get(tensor.name)
            if old is not None and not needs_new_buffer(old.capacity, size):
                continue
            if old is not None:
                self._free(old)
            buffer = _Buffer(tensor, size, cuda.malloc(size), cuda.malloc_host(size))
            self.stats.device_allocations += 1
            self.stats.host_allocations += 1
            self._buffers[tensor.name] = buffer
            if not self.context.set_tensor_address(tensor.name, buffer.device):
                raise RuntimeInputError(f"{self.name}: TensorRT refused the buffer of {tensor.name}")
            self._buffer_generation += 1
            if not tensor.is_input:
                self._output_shapes[tensor.name] = tensor.max_shape

    def _free(self, buffer: _Buffer) -> None:
        cuda = self.group.cuda
        cuda.free(buffer.device)
        cuda.free_host(buffer.host)

    def deactivate(self) -> None:
        """Free everything activation made; the runner can be activated again. Runs whether or not the runner is
        active: it also undoes a failed activation's half (the group's admission, buffers made before the error)."""
        with self.group.lock:
            self._deactivate()
            self._active = False

    def _deactivate(self) -> None:
        group = self.group
        group.use_device()
        if group.stream is not None and (self._pending or self.active):
            group.cuda.synchronize(group.stream)
        self._pending = False
        self._drop_graph()
        if self._refit_pinned and group.budget is not None:
            group.budget.unpin(self.key)
        self._refit_pinned = False
        self._free_resident_weights()  # the stream is synchronized above: no refit still reads them
        if self._lora_base is not None:  # serving LoRAs: the next load is the base plan; a run re-applies its set
            self._applied_set = None
            self.manifest = self._disk_manifest
        for buffer in self._buffers.values():
            self._free(buffer)
        self._buffers.clear()
        self._shapes.clear()
        self._output_shapes.clear()
        self._profile = 0
        self.context = None
        self.engine = None
        group.leave(self)

    # ------------------------------------------------------------------ refit in process (LoRA hot swap)

    def refit(self, weights: Mapping[str, np.ndarray] | None, *, base_onnx: str | Path | None = None,
              base_weights: Mapping[str, np.ndarray] | None = None, resident: bool = False) -> None:
        """Write LoRA-fused weights (ONNX initializer names; None: back to base) into the loaded engine, in
        memory; the plan on disk is untouched (`trt-diffusion refit` rewrites that).

        Queued on the group's stream (`refit_cuda_engine_async`) after every run already queued there, and
        before any later one: no run reads half-written weights. The captured CUDA graph is dropped (it recorded
        the old weights' kernels' parameters) and recaptured on the next runs. With `base_onnx`, every weight comes
        from the ONNX the plan was built from first (no residue of an earlier LoRA); else `base_weights` restore
        what an earlier refit changed. The in-memory manifest records what the engine now holds.

        `resident=True` (per-request LoRA swaps on a serving runner): the weights are uploaded to the GPU once per
        LoRA set (by content digest) and kept there, as are the base values of the weights they change; a swap to a
        resident set then only points TensorRT at device memory (`TensorLocation.DEVICE`) and queues the refit —
        no host copy, no host sync. The first use of a set syncs once, after its upload. The runner keeps
        `resident_lora_sets` sets (least recently used freed first; each counts against the GPU memory bound) and
        frees all of them when the engine unloads. Restoring needs `base_weights` here (the ONNX refitter reads
        host memory)."""
        from . import refit as trt_refit
        from .manifest import RefitRecord
        from .refit_weights import weights_digest

        group = self.group
        with group.lock, self._gpu_memory():
            self.activate()
            assert self.engine is not None and group.stream is not None
            cuda = group.cuda
            # `_pending` stays as it is: every refit below is queued on the stream after the runs already there
            # (the pinned buffers those runs read are still the next host run's to wait for)
            self._drop_graph()
            handle = cuda.stream_handle(group.stream)
            arrays = dict(weights or {})
            if resident:
                if base_onnx is not None:
                    raise RuntimeInputError(f"{self.name}: a device-resident refit restores from base_weights, not "
                                            "base_onnx (the ONNX refitter reads host memory)")
                self._refit_resident(arrays, base_weights, handle)
            elif base_onnx is not None:
                trt_refit.refit_from_base(self.engine, base_onnx, arrays or None, stream_handle=handle)
            elif arrays or self.engine.refitted_names:
                if not arrays:
                    if base_weights is None:
                        raise RuntimeInputError(f"{self.name}: restoring the base weights needs base_onnx or "
                                                "base_weights")
                    trt_refit.refit_to_base(self.engine, base_weights, stream_handle=handle)
                else:
                    trt_refit.refit_engine(self.engine, arrays, base_weights, stream_handle=handle)
            record = (RefitRecord(weights_sha256=weights_digest(arrays), names=tuple(sorted(arrays)))
                      if arrays else None)
            self.manifest = self.manifest.model_copy(update={"refit": record})
            self.engine.manifest = self.manifest
            self.stats.extra["refits"] += 1
            if not self._refit_pinned and group.budget is not None:  # never unloaded behind the LoRA's back
                group.budget.pin(self.key)
                self._refit_pinned = True

    def _refit_resident(self, arrays: dict[str, np.ndarray], base_weights: Mapping[str, np.ndarray] | None,
                        handle: int) -> None:
        from . import refit as trt_refit
        from .refit_weights import weights_for_refit

        assert self.engine is not None
        stale = sorted(set(self.engine.refitted_names) - set(arrays))
        weights_for_refit(self.name, self.engine.refitted_names, arrays, base_weights)  # refuses residue
        if not arrays and not stale:
            return
        lora = self._resident_set(arrays) if arrays else {}
        base = self._resident_base_weights(stale, base_weights)

        def fill(names: list[str]) -> dict[str, DeviceWeights]:  # weights TensorRT fused with the given ones
            return self._resident_base_weights([n for n in names if base_weights and n in base_weights],
                                               base_weights)

        trt_refit.refit_engine_on_device(self.engine, {**base, **lora}, handle, changed=list(arrays), fill=fill)

    def _resident_set(self, arrays: dict[str, np.ndarray]) -> dict[str, DeviceWeights]:
        """The device copy of one LoRA set: uploaded the first time, reused after (least recently used first out)."""
        from .refit_weights import weights_digest

        digest = weights_digest(arrays)
        if digest in self._resident:
            self._resident.use(digest)
            self.stats.extra["resident_reuses"] += 1
            return self._resident_sets[digest]
        uploaded = self._upload(arrays)
        self._resident_sets[digest] = uploaded
        evicted = self._resident.add(digest, sum(w.nbytes for w in uploaded.values()))
        if evicted:
            self.group.cuda.synchronize(self.group.stream)  # a refit queued earlier may still read them
        for old in evicted:
            self._free_device_weights(self._resident_sets.pop(old))
        return uploaded

    def _resident_base_weights(self, names: list[str], base_weights: Mapping[str, np.ndarray] | None
                               ) -> dict[str, DeviceWeights]:
        """Device copies of the base values of `names` (uploaded once each, kept with the engine)."""
        todo = [n for n in names if n not in self._resident_base]
        if todo:
            assert base_weights is not None
            self._resident_base.update(self._upload({n: base_weights[n] for n in todo}))
        return {n: self._resident_base[n] for n in names}

    def _upload(self, arrays: Mapping[str, np.ndarray]) -> dict[str, DeviceWeights]:
        """Cast to the engine's dtypes, copy to fresh device memory on the group's stream, synchronize once (the
        host arrays may go then), and count the bytes against the group's memory bound."""
        from . import refit as trt_refit
        from .refit_weights import check_finite_weights, prepare_refit_weights

        assert self.engine is not None
        group, cuda = self.group, self.group.cuda
        prepared = prepare_refit_weights(self.name, trt_refit.refit_prototypes(self.engine, arrays), arrays)
        check_finite_weights(self.name, prepared)  # once, on the host: the device swaps skip TensorRT's validation
        uploaded: dict[str, DeviceWeights] = {}
        held = 0
        try:
            group.grow(self, sum(max(a.nbytes, 1) for a in prepared.values()))
            held = sum(max(a.nbytes, 1) for a in prepared.values())
            for weight, array in prepared.items():
                pointer = cuda.malloc(max(array.nbytes, 1))
                uploaded[weight] = trt_refit.DeviceWeights(pointer, int(array.size), max(array.nbytes, 1))
                cuda.copy_to_device(pointer, array.ctypes.data, array.nbytes, group.stream)
            cuda.synchronize(group.stream)  # once per upload: every copy has read its host array
        except BaseException:
            cuda.synchronize(group.stream)
            self._free_device_weights(uploaded, grown=held)
            raise
        self.stats.extra["resident_uploads"] += 1
        self.stats.extra["resident_upload_bytes"] += sum(w.nbytes for w in uploaded.values())
        return uploaded

    def _free_device_weights(self, weights: Mapping[str, DeviceWeights], grown: int | None = None) -> None:
        for held in weights.values():
            self.group.cuda.free(held.pointer)
            self.stats.extra["resident_frees"] += 1
        self.group.grow(self, -(sum(w.nbytes for w in weights.values()) if grown is None else grown))

    def _free_resident_weights(self) -> None:
        """Every device-resident refit weight of this runner (the engine unloads: LRU eviction, deactivate)."""
        for digest in self._resident.clear():
            self._free_device_weights(self._resident_sets.pop(digest))
        self._free_device_weights(self._resident_base)
        self._resident_base = {}

    def _drop_graph(self) -> None:
        if self._graph is not None:
            self.group.cuda.graph_destroy(self._graph)
        self._graph, self._graph_key, self._warm_key = None, None, None

    # ------------------------------------------------------------------ running

    # BaseRunner.run: `_check_feeds`, then `_run` inside `_in_use`. numpy in, numpy out; a torch CUDA tensor
    # among the feeds: torch CUDA tensors out.

    def _check_feeds(self, feeds: Mapping[str, Any]) -> None:
        """Names, dtypes and the profile's shape ranges, from the manifest, before anything reaches TensorRT."""
        check_feeds(self.manifest, {k: _FeedView(v) for k, v in feeds.items()})

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """One run: the group's lock on its GPU, the plan on disk still the one read, the engine loaded and pinned
        (never unloaded while it runs)."""
        group = self.group
        with group.lock:
            group.use_device()
            self._refuse_if_changed_on_disk()
            self.activate()
            assert group.budget is not None
            group.budget.pin(self.key)
            try:
                with self._gpu_memory():
                    if self._lora_base is not None:  # serving LoRAs: this run's set first, queued before its copies
                        self._apply_set(self._wanted_set)
                    yield
            finally:
                group.budget.unpin(self.key)

    # ------------------------------------------------------------------ LoRA per request (TensorRTTarget.lora_runner)

    @property
    def serving_loras(self) -> bool:
        return self._lora_base is not None

    def serve_loras(self, base_weights: Mapping[str, np.ndarray], resident_sets: int | None = None) -> None:
        """Serve LoRA sets per request (a Triton engine model): `base_weights` (ONNX initializer names) are the base
        values of every weight a served set changes. From now on each run holds the set it asks for: `run` the
        base weights, `run_with_set` a LoRA set; a swap is a device-resident refit queued on the runner's stream
        before the run's copies (`refit(..., resident=True)`: each set uploaded once, `resident_sets` kept: the
        LoRA set cache's size, so the GPU keeps the sets the cache does)."""
        with self.group.lock:
            if self._lora_base is None:
                self._lora_base = dict(base_weights)
            if resident_sets is not None:
                self._resident.capacity = max(1, int(resident_sets))

    def run_with_set(self, feeds: Mapping[str, Any], digest: str, weights: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """One run with LoRA set `weights` (its content digest `digest`) in the engine."""
        with self.group.lock:  # the set and the run it is for, under one hold of the lock: never another's batch
            self._wanted_set = (digest, weights)
            try:
                return self.run(feeds)
            finally:
                self._wanted_set = None

    def _apply_set(self, wanted: tuple[str, Mapping[str, np.ndarray]] | None) -> None:
        digest, weights = wanted if wanted is not None else (None, None)
        if digest == self._applied_set:
            return
        self._applied_set = None  # until the refit below is queued: a failed swap leaves nothing assumed
        self.refit(dict(weights) if weights else None, base_weights=self._lora_base, resident=True)
        self._applied_set = digest

    def _run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        group, cuda = self.group, self.group.cuda
        context = self.context
        assert context is not None
        stream = group.stream
        on_device = outputs_on_device(feeds)
        shapes = {name: describe_feed(value).shape for name, value in feeds.items()}
        if self.manifest.profiles:  # engine_layout: profiles: the routed profile, else the tightest that holds these
            wanted = select_profile(self.manifest.profiles, shapes, ROUTED_PROFILE.get())
            if wanted is None:  # check_feeds let it through: a bug, not a user error
                raise AssertionError(f"{self.name}: no profile for {shapes}")
            if wanted != self._profile:
                if self._pending:
                    cuda.synchronize(stream)
                    self._pending = False
                self._select_profile(context, wanted)
        if shapes != {k: self._shapes.get(k) for k in shapes}:
            for name, shape in shapes.items():
                self._set_shape(context, name, shape)
            self._output_shapes = {n: _dims(context.get_tensor_shape(n)) for n in self.output_names}
            self._grow_outputs()
        if self._pending:  # the last call's copies may still read the pinned buffers about to be rewritten
            cuda.synchronize(stream)
            self._pending = False
        if self.bound_generation != group.activation_generation:  # the shared allocation moved or was freed
            group.bind_activation(self, context, self._activation_need)
        # device sources: `.contiguous()` may queue a copy on torch's stream, so the runner's stream waits on
        # torch's only after every such copy is queued; they stay referenced until their copies are queued
        keep = {name: value.contiguous() for name, value in feeds.items() if describe_feed(value).on_device}
        torch_stream = _torch_stream() if keep else None
        if torch_stream is not None:
            cuda.wait(stream, torch_stream, group.event())  # the producer's work (and the copies) come first
        for name, value in feeds.items():
            buffer = self._buffers[name]
            nbytes = tensor_bytes(shapes[name], buffer.tensor.dtype)
            if name in keep:
                cuda.copy_on_device(buffer.device, int(keep[name].data_ptr()), nbytes, stream)
            else:
                array = np.ascontiguousarray(value)
                host_array(buffer.host, nbytes, array.dtype, array.shape)[...] = array
                cuda.copy_to_device(buffer.device, buffer.host, nbytes, stream)
        self._execute(context, stream, shapes)
        self.stats.runs += 1
        if on_device:
            outputs = self._device_outputs(stream, torch_stream)
            # only a host feed among them went through the pinned buffers the next call rewrites: a step whose
            # feeds are all on the device leaves nothing to wait for (the stream orders the device buffers)
            self._pending = len(keep) < len(feeds)
            del keep
            return outputs
        return self._host_outputs(stream)

    def _grow_outputs(self) -> None:
        """Shapes inside the profile fit the buffers made at activation; grow one only if TensorRT infers
        a larger output than the largest-shape inference did (data-dependent shapes)."""
        grown = [IOTensor(n, False, self._buffers[n].tensor.dtype, s) for n, s in self._output_shapes.items()
                 if needs_new_buffer(self._buffers[n].capacity, tensor_bytes(s, self._buffers[n].tensor.dtype))]
        if grown:
            self.group.cuda.synchronize(self.group.stream)
            self._allocate(grown)

    def _execute(self, context: trt.IExecutionContext, stream: Any, shapes: dict[str, Shape]) -> None:
        cuda = self.group.cuda
        handle = cuda.stream_handle(stream)
        if self.stats.graph_skip_reason is None:
            key = GraphKey.of(shapes, self.group.activation_generation, self._buffer_generation)
            if graph_is_valid(self._graph_key, key):
                cuda.graph_launch(self._graph, stream)
                self.stats.graph_launches += 1
                return
            if self._warm_key == key:  # one eager run with these addresses came first, as TensorRT asks
                self._capture(context, stream, handle, key)
                cuda.graph_launch(self._graph, stream)
                self.stats.graph_launches += 1
                return
            self._warm_key = key
        if not context.execute_async_v3(handle):
            raise RuntimeInputError(f"{self.name}: TensorRT failed to enqueue the engine (see its log)")
        self.stats.eager_runs += 1

    def _capture(self, context: trt.IExecutionContext, stream: Any, handle: int, key: GraphKey) -> None:
        cuda = self.group.cuda
        if self._graph is not None:
            cuda.graph_destroy(self._graph)
            self._graph, self._graph_key = None, None
        cuda.begin_capture(stream)
        try:
            ok = context.execute_async_v3(handle)
        except BaseException:
            cuda.abort_capture(stream)
            raise
        if not ok:
            cuda.abort_capture(stream)
            raise RuntimeInputError(f"{self.name}: TensorRT failed to enqueue the engine while capturing a graph")
        self._graph = cuda.end_capture(stream)
        self._graph_key = key
        self.stats.graph_captures += 1

    def _host_outputs(self, stream: Any) -> dict[str, Any]:
        cuda = self.group.cuda
        for name in self.output_names:
            buffer = self._buffers[name]
            cuda.copy_to_host(buffer.host, buffer.device, tensor_bytes(self._output_shapes[name], buffer.tensor.dtype),
                              stream)
        cuda.synchronize(stream)
        outputs = {}
        for name in self.output_names:
            buffer = self._buffers[name]
            dtype = numpy_dtype_for(buffer.tensor.dtype)
            if dtype is None:
                raise RuntimeInputError(f"{self.name}: output {name} is {buffer.tensor.dtype}, which numpy cannot hold")
            shape = self._output_shapes[name]
            outputs[name] = host_array(buffer.host, tensor_bytes(shape, buffer.tensor.dtype), dtype, shape).copy()
        return outputs

    def _device_outputs(self, stream: Any, torch_stream: Any) -> dict[str, Any]:
        cuda, outputs = self.group.cuda, {}
        for name in self.output_names:
            buffer = self._buffers[name]
            shape = self._output_shapes[name]
            out = _device_empty(shape, buffer.tensor.dtype)
            cuda.copy_on_device(int(out.data_ptr()), buffer.device, tensor_bytes(shape, buffer.tensor.dtype), stream)
            outputs[name] = out
        cuda.wait(torch_stream if torch_stream is not None else _torch_stream(), stream, self.group.event())
        return outputs


def _device_empty(shape: Shape, dtype: str) -> Any:
    """A torch CUDA tensor for an output of manifest dtype `dtype` (fp8 outputs are torch's float8_e4m3fn)."""
    import torch

    return torch.empty(shape, dtype=getattr(torch, torch_dtype_name(dtype)), device="cuda")


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _torch_stream() -> int:
    import torch

    return int(torch.cuda.current_stream().cuda_stream)
