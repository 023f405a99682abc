"""Ctrl-C and SIGTERM for the serve command: both become KeyboardInterrupt from the first moment, and a stop
that arrives while a child process is being started waits until the child is recorded, so whoever stops
the server can always find it.

Python's default SIGTERM ends the process at once, without `finally` blocks: a tritonserver started in its
own session (so that stopping it stops its stubs) is then left running with its ports bound.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (main thread only; elsewhere a no-op)."""
    if not _main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_interrupt) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def deferred_stop_signals() -> Iterator[None]:
    """SIGINT / SIGTERM arriving inside the block are held and delivered when it ends (to the handlers that
    were in place before it). Wraps "start a child and record it": a stop is never lost between the two."""
    if not _main_thread():
        yield
        return
    pending: list[int] = []
    previous = {signum: signal.signal(signum, lambda n, _f: pending.append(n)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)
