"""`cfg: parallel`: a step's conditional and unconditional denoiser calls issued at once, on two instances of the
same engine, and combined exactly as `split` combines them one after the other — so its images equal split's bit
for bit (each call computes what it computes alone; only the waiting overlaps).

Instances. In process they are two runners over the engine, made by the loader for the components CFG calls
twice a step (`cfg_instances`): two ONNX Runtime sessions, or two OpenVINO compiled models (an OpenVINO runner
holds one infer request behind a lock, so two calls on one runner would run one after the other). Inside Triton
the BLS runner is one object whose two calls, issued from two threads, go to two instances of the engine's model
(`instance_group` count 2 on CPU, one instance per GPU on a GPU host), which Triton schedules independently: the
python backend's own `async_exec` is the same thing, `request.exec` run on an executor thread.

Threads, not processes: the engine runners release the GIL while they run (ONNX Runtime, OpenVINO, a BLS call's
wait, TensorRT), and a thread reads the request's arrays without copying them.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

from ..engines_file.schema import CfgMode
from ..errors import ConfigError
from ..families import Component

PARALLEL_INSTANCES = 2  # conditional and unconditional: one instance each
# Workers for the second half of every parallel step in this process. One per caller running a step at once
# (a Triton python instance runs one execute at a time: one); more callers than workers only wait for a worker.
MAX_WORKERS = 8
_pool_lock = threading.Lock()
_workers: futures.ThreadPoolExecutor | None = None  # made on first use, in each process

T = TypeVar("T")


def cfg_modes(values) -> tuple[CfgMode, ...]:
    """engines.yaml's `cfg` (names or CfgMode) as CfgModes; a name no mode has is a ConfigError naming the modes."""
    try:
        return tuple(dict.fromkeys(CfgMode(value) for value in values or ()))
    except ValueError:
        raise ConfigError(f"unknown cfg mode in {[str(getattr(v, 'value', v)) for v in values]}; choose from "
                          f"{', '.join(m.value for m in CfgMode)}") from None


def cfg_instances(component: Component | str, modes) -> int:
    """Runners (Triton instances) one engine of `component` gets: two for the components CFG calls twice a step (the
    denoisers and their ControlNets) when `cfg: parallel` is declared, one otherwise."""
    component = Component(component)
    calls_twice = component.is_denoiser or component is Component.controlnet
    return PARALLEL_INSTANCES if calls_twice and CfgMode.parallel in cfg_modes(modes) else 1


def at_once(first: Callable[[], T], second: Callable[[], T]) -> tuple[T, T]:
    """(first(), second()), run at the same time: `first` in this thread, `second` on a worker thread (in a copy of
    this thread's context: a routed TensorRT profile reaches it). Both have finished when this returns or raises —
    no engine call is left running behind the caller; `first`'s error wins when both fail."""
    pending = _pool().submit(contextvars.copy_context().run, second)
    try:
        result = first()
    except BaseException:
        futures.wait([pending])
        raise
    return result, pending.result()



def _pool() -> futures.ThreadPoolExecutor:
    global _workers
    with _pool_lock:
        if _workers is None:
            _workers = futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="cfg-parallel")
        return _workers


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool without its threads: it would count the parent's idle workers as its own
    # and queue work no thread ever takes. The child makes its own (and a fresh lock: one held at the fork stays so).
    global _workers, _pool_lock
    _workers, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)
