"""A stand-in for TensorRT and the CUDA runtime, for testing the runner's bookkeeping on CPU.

NO REAL PART OF TENSORRT OR CUDA CAN RUN HERE: TensorRT is not on the registries these machines reach and
there is no GPU. So the runner's bookkeeping (contexts and buffers made once, reused, freed; graph capture
only for static shapes; one shared activation allocation) is tested against this fake. It is generated
from the `tensorrt-stubs` .pyi (the TensorRT 10.13 Python API), so it cannot drift from the real API:

- every class of the fake is a class of the stub, and has exactly the stub's members: touching a name the
  stub lacks is an AttributeError, setting one is too (the runner cannot use a misspelled or removed API);
- each behaviour a test gives is checked against the stub when the fake is made: the member must exist
  with the same parameter names, and arguments annotated `int`/`str`/`bool` in the stub are checked at
  each call (a cuda-python stream object where TensorRT wants an int handle fails here as it would there);
- a stub member without a behaviour raises NotImplementedError naming it;
- enums (DataType, TensorIOMode, ExecutionContextAllocationStrategy) take their members from the stub.

The fake CUDA runtime mirrors cuda-python's `cuda.bindings.runtime` calls the runner's `Cuda` wrapper makes
(each returns `(cudaError_t, value...)`); a test checks its names against the real cuda-python where that
is installed. Device memory is bytes in a dict, host memory real (ctypes) memory, so data flows through the
runner's real copies and the outputs can be checked.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import inspect
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

STUB_PACKAGE = "tensorrt-stubs==10.13.0.35.1"


def stub_path() -> Path | None:
    """tensorrt_bindings/tensorrt.pyi of the installed tensorrt-stubs, or None."""
    spec = importlib.util.find_spec("tensorrt_bindings")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "tensorrt.pyi"
        if candidate.is_file():
            return candidate
    return None


# The stub is not valid Python in two places (a parameter named `in`; a non-default parameter after
# defaults); fixed textually before parsing, nothing else is changed.
_SANITIZE = ((re.compile(r"\bin: "), "in_: "), (re.compile(r", channel_axis: int\)"), ", channel_axis: int = ...)"))


@dataclass
class StubMember:
    kind: str  # method | property | attribute | enum
    signatures: list[list[tuple[str, str]]] = field(default_factory=list)  # per overload: (param, annotation)
    settable: bool = False


@dataclass
class StubClass:
    name: str
    members: dict[str, StubMember]


def parse_stub(text: str) -> dict[str, StubClass]:
    for pattern, replacement in _SANITIZE:
        text = pattern.sub(replacement, text)
    tree = ast.parse(text)
    classes = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = StubClass(node.name, _members(node))
    return classes


def _members(node: ast.ClassDef) -> dict[str, StubMember]:
    members: dict[str, StubMember] = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            decorators = {ast.unparse(d) for d in item.decorator_list}
            if "property" in decorators:
                members.setdefault(item.name, StubMember("property"))
            elif any(d.endswith(".setter") for d in decorators):
                members.setdefault(item.name, StubMember("property")).settable = True
            elif "staticmethod" not in decorators or not item.name.startswith("__"):
                args = [a for a in item.args.args if a.arg not in ("self", "this")]
                signature = [(a.arg, ast.unparse(a.annotation) if a.annotation else "") for a in args]
                members.setdefault(item.name, StubMember("method")).signatures.append(signature)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            annotation = ast.unparse(item.annotation)
            if annotation.startswith("typing.ClassVar"):
                if annotation == f"typing.ClassVar[{node.name}]":
                    members[item.target.id] = StubMember("enum")
            else:
                members[item.target.id] = StubMember("attribute", settable=True)
    return members


_SIMPLE = {"int": int, "str": str, "bool": bool}


def _functions(scope: dict) -> dict[str, Callable]:
    """The functions defined in a scope (not the closure's other names)."""
    return {k: v for k, v in scope.items() if inspect.isfunction(v) and v.__name__ == k}


class StubMismatch(AssertionError):
    """A behaviour given to the fake does not match the real API."""


def _check_behaviour(cls: StubClass, name: str, impl: Callable) -> None:
    member = cls.members.get(name)
    if member is None:
        raise StubMismatch(f"tensorrt.{cls.name} has no member {name!r} in the stubs")
    if member.kind != "method":
        return
    params = [p for p in inspect.signature(impl).parameters if p != "self"]
    if not any([n for n, _ in sig] == params for sig in member.signatures):
        wanted = " | ".join(str([n for n, _ in sig]) for sig in member.signatures)
        raise StubMismatch(f"fake tensorrt.{cls.name}.{name}{params} does not match the stub's {wanted}")


def _checked(cls: StubClass, name: str, impl: Callable) -> Callable:
    signatures = cls.members[name].signatures

    def call(self, *args, **kwargs):
        for sig in signatures:
            if len(args) + len(kwargs) > len(sig):
                continue
            bound = dict(zip([n for n, _ in sig], args)) | kwargs
            problems = [f"{n}={bound[n]!r} is not {a}" for n, a in sig
                        if n in bound and a in _SIMPLE and not isinstance(bound[n], _SIMPLE[a])]
            if not problems:
                return impl(self, *args, **kwargs)
        raise TypeError(f"tensorrt.{cls.name}.{name}{args}: the stub's types are {signatures}")

    return call


def make_class(cls: StubClass, behaviours: dict[str, Callable]) -> type:
    """A class with exactly the stub's members; `behaviours` implement some of them (methods, or
    properties given as one-argument functions)."""
    for name, impl in behaviours.items():
        _check_behaviour(cls, name, impl)
    namespace: dict[str, Any] = {}
    for name, impl in behaviours.items():
        kind = cls.members[name].kind
        namespace[name] = property(impl) if kind == "property" else _checked(cls, name, impl) if kind == "method" else impl

    def __getattr__(self, name):  # only called for names not set above
        member = cls.members.get(name)
        if member is None:
            raise AttributeError(f"tensorrt.{cls.name} has no attribute {name!r} (not in the TensorRT stubs)")
        raise NotImplementedError(f"fake tensorrt.{cls.name}.{name} is in the stubs but this fake does not implement it")

    def __setattr__(self, name, value):
        if not name.startswith("_") and not (name in cls.members and cls.members[name].settable):
            raise AttributeError(f"tensorrt.{cls.name}.{name} cannot be set (not a settable member in the stubs)")
        object.__setattr__(self, name, value)

    namespace["__getattr__"] = __getattr__
    namespace["__setattr__"] = __setattr__
    return type(f"Fake{cls.name}", (), namespace)


class _EnumMember:
    def __init__(self, owner: str, name: str):
        self.owner, self.name = owner, name

    def __repr__(self) -> str:
        return f"<{self.owner}.{self.name}>"


def make_enum(cls: StubClass) -> SimpleNamespace:
    names = [n for n, m in cls.members.items() if m.kind == "enum"]
    if not names:
        raise StubMismatch(f"tensorrt.{cls.name} has no enum members in the stubs")
    return SimpleNamespace(**{n: _EnumMember(cls.name, n) for n in names})


# ----------------------------------------------------------------------------------------------
# A fake engine: I/O tensors, a profile, a function computing the outputs
# ----------------------------------------------------------------------------------------------

NUMPY_OF = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64}


@dataclass
class EngineDescription:
    inputs: dict[str, tuple[str, tuple, tuple, tuple]]  # name -> (DataType member, min, opt, max)
    outputs: dict[str, str]  # name -> DataType member
    output_shape: Callable[[dict[str, tuple]], dict[str, tuple]]
    compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
    activation_bytes: int = 1 << 20
    # optimization profiles (engine_layout: profiles): name -> (min, opt, max) each; None: inputs' ranges only
    profiles: list[dict[str, tuple]] | None = None


class FakeTensorRT:
    """The fake `tensorrt` module: enums, and engines built from EngineDescriptions."""

    def __init__(self, stub: Path | None = None):
        stub = stub or stub_path()
        if stub is None:
            raise FileNotFoundError(f"tensorrt-stubs are not installed (pip install --no-deps {STUB_PACKAGE})")
        self.classes = parse_stub(stub.read_text())
        for enum in ("DataType", "TensorIOMode", "ExecutionContextAllocationStrategy"):
            setattr(self, enum, make_enum(self.classes[enum]))
        self.contexts: list[Any] = []

    def engine(self, description: EngineDescription, cuda: FakeCudart) -> Any:
        trt = self
        names = [*description.inputs, *description.outputs]

        def context_behaviours():
            def set_input_shape(self, name: str, shape: tuple) -> bool:
                low, high = description.inputs[name][1], description.inputs[name][3]
                if description.profiles:
                    low, _, high = description.profiles[self._profile][name]
                ok = len(shape) == len(low) and all(lo <= d <= hi for d, lo, hi in zip(shape, low, high))
                if ok:
                    self._shapes[name] = tuple(shape)
                return ok

            def get_tensor_shape(self, name: str) -> Any:
                if name in description.inputs:
                    return Dims(self._shapes.get(name, description.inputs[name][3]))
                return Dims(description.output_shape(self._shapes)[name])

            def set_tensor_address(self, name: str, memory: int) -> bool:
                self._addresses[name] = memory
                return name in names

            def set_device_memory(self, memory: int, size: int) -> None:
                self._activation = (memory, size)

            def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
                if not description.profiles or not 0 <= profile_index < len(description.profiles):
                    return False
                self._profile = profile_index
                self._shapes.clear()  # TensorRT: every input shape must be set again
                self._calls["set_optimization_profile_async"] += 1
                return True

            def execute_async_v3(self, stream_handle: int) -> bool:
                if self._activation is None or self._activation[1] < description.activation_bytes:
                    raise AssertionError("executed without enough activation memory bound")
                work = self._enqueue
                if cuda.capturing.get(stream_handle) is not None:
                    cuda.capturing[stream_handle].append(work)
                else:
                    work()
                self._calls["execute_async_v3"] += 1
                return True

            return _functions(locals())

        Context = make_class(self.classes["IExecutionContext"], context_behaviours())

        def enqueue(self) -> None:
            feeds = {}
            for name, (dtype, *_rest) in description.inputs.items():
                shape = self._shapes[name]
                feeds[name] = cuda.read(self._addresses[name], NUMPY_OF[dtype], shape)
            for name, value in description.compute(feeds).items():
                cuda.write(self._addresses[name], np.ascontiguousarray(value, NUMPY_OF[description.outputs[name]]))

        def context_init(self):
            object.__setattr__(self, "_shapes", {})
            object.__setattr__(self, "_addresses", {})
            object.__setattr__(self, "_activation", None)
            object.__setattr__(self, "_profile", 0)
            object.__setattr__(self, "_calls", Counter())
            object.__setattr__(self, "_enqueue", lambda: enqueue(self))

        Context.__init__ = context_init

        def engine_behaviours():
            def create_execution_context(self, strategy: Any) -> Any:
                if strategy is not trt.ExecutionContextAllocationStrategy.USER_MANAGED:
                    raise AssertionError(f"the runner must manage activation memory itself, asked for {strategy}")
                context = Context()
                trt.contexts.append(context)
                return context

            def get_tensor_name(self, index: int) -> str:
                return names[index]

            def get_tensor_mode(self, name: str) -> Any:
                return trt.TensorIOMode.INPUT if name in description.inputs else trt.TensorIOMode.OUTPUT

            def get_tensor_dtype(self, name: str) -> Any:
                member = description.inputs[name][0] if name in description.inputs else description.outputs[name]
                return getattr(trt.DataType, member)

            def get_tensor_profile_shape(self, name: str, profile_index: int) -> list:
                if description.profiles:
                    return [Dims(s) for s in description.profiles[profile_index][name]]
                return [Dims(s) for s in description.inputs[name][1:]]

            def num_io_tensors(self) -> int:
                return len(names)

            def device_memory_size_v2(self) -> int:
                return description.activation_bytes

            return _functions(locals())

        Engine = make_class(self.classes["ICudaEngine"], engine_behaviours())
        Dims = self.dims_class()
        return Engine()

    def dims_class(self) -> type:
        cls = self.classes["Dims"]

        def getitem(self, arg0: int) -> int:
            return self._values[arg0]

        def length(self) -> int:
            return len(self._values)

        Dims = make_class(cls, {"__getitem__": getitem, "__len__": length})

        def init(self, values=()):
            object.__setattr__(self, "_values", tuple(int(v) for v in values))

        Dims.__init__ = init
        return Dims


# ----------------------------------------------------------------------------------------------
# The fake CUDA runtime (cuda-python's cuda.bindings.runtime calls)
# ----------------------------------------------------------------------------------------------


class _Handle:
    def __init__(self, kind: str, value: int):
        self.kind, self.value = kind, value

    def __int__(self) -> int:
        return self.value


class FakeCudart:
    """The calls of cuda.bindings.runtime the runner makes, with live-allocation accounting."""

    cudaError_t = SimpleNamespace(cudaSuccess="cudaSuccess", cudaErrorMemoryAllocation="cudaErrorMemoryAllocation")
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice="HtoD", cudaMemcpyDeviceToHost="DtoH",
                                     cudaMemcpyDeviceToDevice="DtoD")
    cudaStreamCaptureMode = SimpleNamespace(cudaStreamCaptureModeThreadLocal="thread_local")
    cudaStreamNonBlocking = 1
    cudaEventDisableTiming = 2

    def __init__(self, total_bytes: int = 8 << 30):
        self.total_bytes = total_bytes
        self.device: dict[int, bytearray] = {}
        self.host: dict[int, Any] = {}
        self.calls: Counter[str] = Counter()
        self.capturing: dict[int, list | None] = {}
        self.streams: set[int] = set()
        self.current_device = 0
        self.malloc_devices: set[int] = set()  # the devices allocations were made on
        self._next = 1 << 20

    def _count(self, name: str) -> None:
        self.calls[name] += 1

    def _new(self) -> int:
        self._next += 1 << 40  # far apart: no fake buffer reaches the next
        return self._next

    def _owner(self, pointer: int) -> tuple[bytearray, int]:
        for base, memory in self.device.items():
            if base <= pointer < base + max(len(memory), 1):
                return memory, pointer - base
        raise AssertionError(f"device address {pointer:#x} is not allocated (freed or never allocated)")

    def read(self, pointer: int, dtype, shape) -> np.ndarray:
        memory, offset = self._owner(pointer)
        count = int(np.prod(shape))
        return np.frombuffer(bytes(memory[offset:offset + count * np.dtype(dtype).itemsize]), dtype).reshape(shape)

    def write(self, pointer: int, array: np.ndarray) -> None:
        memory, offset = self._owner(pointer)
        data = array.tobytes()
        assert offset + len(data) <= len(memory), "write past the end of a device buffer"
        memory[offset:offset + len(data)] = data

    @property
    def live_device(self) -> int:
        return len(self.device)

    @property
    def live_host(self) -> int:
        return len(self.host)

    # devices: the current device of the calling thread, as CUDA keeps it
    def cudaSetDevice(self, device):
        self._count("cudaSetDevice")
        self.current_device = device
        return (self.cudaError_t.cudaSuccess,)

    # memory
    def cudaMalloc(self, size):
        self._count("cudaMalloc")
        self.malloc_devices.add(self.current_device)
        if sum(map(len, self.device.values())) + size > self.total_bytes:
            return (self.cudaError_t.cudaErrorMemoryAllocation, None)
        pointer = self._new()
        self.device[pointer] = bytearray(size)
        return (self.cudaError_t.cudaSuccess, pointer)

    def cudaFree(self, devPtr):
        self._count("cudaFree")
        assert devPtr in self.device, f"cudaFree of {devPtr:#x}, which is not allocated"
        del self.device[devPtr]
        return (self.cudaError_t.cudaSuccess,)

    def cudaMallocHost(self, size):
        self._count("cudaMallocHost")
        buffer = ctypes.create_string_buffer(size)
        pointer = ctypes.addressof(buffer)
        self.host[pointer] = buffer
        return (self.cudaError_t.cudaSuccess, pointer)

    def cudaFreeHost(self, ptr):
        self._count("cudaFreeHost")
        assert ptr in self.host, f"cudaFreeHost of {ptr:#x}, which is not allocated"
        del self.host[ptr]
        return (self.cudaError_t.cudaSuccess,)

    def cudaMemGetInfo(self):
        self._count("cudaMemGetInfo")
        used = sum(map(len, self.device.values()))
        return (self.cudaError_t.cudaSuccess, self.total_bytes - used, self.total_bytes)

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        self._count(f"cudaMemcpyAsync({kind})")
        assert int(stream) in self.streams or isinstance(stream, int), "copy on a stream that was not created"
        if kind == "HtoD":
            self.write(dst, np.frombuffer(ctypes.string_at(src, count), np.uint8))
        elif kind == "DtoH":
            ctypes.memmove(dst, bytes(self.read(src, np.uint8, (count,))), count)
        else:
            self.write(dst, self.read(src, np.uint8, (count,)))
        return (self.cudaError_t.cudaSuccess,)

    # streams, events
    def cudaStreamCreateWithFlags(self, flags):
        self._count("cudaStreamCreateWithFlags")
        assert flags == self.cudaStreamNonBlocking
        handle = _Handle("stream", self._new())
        self.streams.add(int(handle))
        return (self.cudaError_t.cudaSuccess, handle)

    def cudaStreamDestroy(self, stream):
        self._count("cudaStreamDestroy")
        self.streams.discard(int(stream))
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamSynchronize(self, stream):
        self._count("cudaStreamSynchronize")
        return (self.cudaError_t.cudaSuccess,)

    def cudaEventCreateWithFlags(self, flags):
        self._count("cudaEventCreateWithFlags")
        return (self.cudaError_t.cudaSuccess, _Handle("event", self._new()))

    def cudaEventDestroy(self, event):
        self._count("cudaEventDestroy")
        return (self.cudaError_t.cudaSuccess,)

    def cudaEventRecord(self, event, stream):
        self._count("cudaEventRecord")
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        self._count("cudaStreamWaitEvent")
        return (self.cudaError_t.cudaSuccess,)

    # graphs: work enqueued while capturing is recorded, not run; a launch runs it
    def cudaStreamBeginCapture(self, stream, mode):
        self._count("cudaStreamBeginCapture")
        self.capturing[int(stream)] = []
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamEndCapture(self, stream):
        self._count("cudaStreamEndCapture")
        work = self.capturing.pop(int(stream), None)
        return (self.cudaError_t.cudaSuccess, _Handle("graph", self._new()) if work is None else ("graph", work))

    def cudaGraphInstantiate(self, graph, flags):
        self._count("cudaGraphInstantiate")
        return (self.cudaError_t.cudaSuccess, ("exec", graph[1]))

    def cudaGraphDestroy(self, graph):
        self._count("cudaGraphDestroy")
        return (self.cudaError_t.cudaSuccess,)

    def cudaGraphLaunch(self, graphExec, stream):
        self._count("cudaGraphLaunch")
        for work in graphExec[1]:
            work()
        return (self.cudaError_t.cudaSuccess,)

    def cudaGraphExecDestroy(self, graphExec):
        self._count("cudaGraphExecDestroy")
        return (self.cudaError_t.cudaSuccess,)


CUDART_NAMES = sorted(n for n in vars(FakeCudart) if n.startswith("cuda"))
