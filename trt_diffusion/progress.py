"""Live progress of long work as plain lines: stage, step k of n, elapsed.

Library code reports through `task(stage, ...)`: each record goes to the `trt_diffusion.progress` logger
as one line, stamped with the command's clock,

    [   52.3s] export 2/5 sd15-tiny.unet.fp32: exporting
    [  112.3s] export 2/5 sd15-tiny.unet.fp32: exporting (still running)

and a task that reports nothing for `HEARTBEAT_S` seconds logs a "still running" line, so a long
torch.onnx.export, calibration or engine build shows it is alive in a CI log. The stamp is the command's
one clock (successive tasks do not restart it); a task's own time ends its "done" line.

Nothing is printed until someone listens: the CLI calls `show_plain_lines()` when stderr is not a terminal
(CI, `> build.log 2>&1`), where rich's live bars print nothing; on a terminal the bars show the same
progress. Scripts can `logging.basicConfig(level=logging.INFO)` instead. `TRT_DIFFUSION_PROGRESS=plain`
forces the lines on a terminal too; `=off` silences them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import IO

LOGGER_NAME = "trt_diffusion.progress"
log = logging.getLogger(LOGGER_NAME)


def _heartbeat_default() -> float:
    try:
        return float(os.environ.get("TRT_DIFFUSION_HEARTBEAT_S", "30"))
    except ValueError:
        return 30.0


HEARTBEAT_S = _heartbeat_default()

# One clock for every line of a command: seconds since it started (show_plain_lines restarts it), so the
# timestamps of nested and successive tasks read as one timeline; each task's own duration is in its "done" line.
_clock_start = time.monotonic()


def clock() -> float:
    return time.monotonic() - _clock_start


class Task:
    """One piece of long work. `step(k, detail)` says step k (1-based) of `total` has started; a
    heartbeat thread repeats the last line, marked "still running", when nothing was said for a while.

    Use as a context manager; leaving it with an exception logs "failed", otherwise `done_message`.
    """

    def __init__(self, stage: str, *, total: int | None = None, subject: str = "", position: int | None = None,
                 detail: str = "started", heartbeat_s: float | None = None, min_interval_s: float = 0.0,
                 done_message: str | None = "done"):
        self.stage, self.total, self.subject = stage, total, subject
        self.position = position
        self.detail = detail
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.min_interval_s = min_interval_s  # steps closer together than this are not all printed
        self.done_message = done_message
        self.started = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def line(self, detail: str | None = None) -> str:
        count = ""
        if self.position is not None:
            count = f" {self.position}/{self.total}" if self.total else f" {self.position}"
        subject = f" {self.subject}" if self.subject else ""
        return f"[{clock():>9.1f}s] {self.stage}{count}{subject}: {self.detail if detail is None else detail}"

    def step(self, position: int | None = None, detail: str | None = None, *, total: int | None = None,
             force: bool = False) -> None:
        """Step `position` (1-based, of `total`) has started; `detail` says what it is."""
        with self._lock:
            if total is not None:
                self.total = total
            if position is not None:
                self.position = position
            if detail is not None:
                self.detail = detail
            last_step = self.total is not None and self.position == self.total
            if not force and not last_step and time.monotonic() - self._last < self.min_interval_s:
                return
            self._emit(self.line())

    def _emit(self, text: str) -> None:
        self._last = time.monotonic()
        log.info("%s", text, extra={"progress_task": self})  # the task itself, for listeners that want fields

    def _beat(self) -> None:
        while not self._stop.wait(min(self.heartbeat_s, 5.0)):
            with self._lock:
                if time.monotonic() - self._last >= self.heartbeat_s:
                    self._emit(self.line(f"{self.detail} (still running)"))

    def __enter__(self) -> Task:
        if not log.isEnabledFor(logging.INFO):
            return self  # nobody listens: no lines, no thread
        self.step(force=True)
        if self.heartbeat_s > 0:
            self._thread = threading.Thread(target=self._beat, name=f"progress-{self.stage}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if log.isEnabledFor(logging.INFO):
            with self._lock:
                if exc_type is not None:
                    self._emit(self.line(f"failed after {self.elapsed:.1f} s ({exc_type.__name__})"))
                elif self.done_message:
                    self._emit(self.line(f"{self.done_message} in {self.elapsed:.1f} s"))
        return False


def task(stage: str, **options) -> Task:
    """A `Task` context manager: `with progress.task("calibration", total=32) as t: t.step(1, "prompt 1")`."""
    return Task(stage, **options)


class _PlainLines(logging.Handler):
    """Each record's message as one line, flushed; the stream is looked up at each line when not given,
    so a swapped sys.stderr (pytest, click's CliRunner) gets the lines instead of a closed stream."""

    def __init__(self, stream: IO[str] | None = None):
        super().__init__(logging.INFO)
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = self._stream or sys.stderr
            stream.write(record.getMessage() + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never take the command down
            self.handleError(record)


_handler: logging.Handler | None = None


def show_plain_lines(stream: IO[str] | None = None) -> logging.Handler:
    """Print progress lines to `stream` (default: stderr at the time of each line). Idempotent."""
    global _handler, _clock_start
    if _handler is None:
        _clock_start = time.monotonic()
        _handler = _PlainLines(stream)
        log.addHandler(_handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # the lines are the whole message; no root handler prints them twice
    return _handler


def hide_plain_lines() -> None:
    """Undo `show_plain_lines`."""
    global _handler
    if _handler is not None:
        log.removeHandler(_handler)
        log.setLevel(logging.NOTSET)
        log.propagate = True
        _handler = None


def plain_lines_wanted(stream: IO[str] | None = None) -> bool:
    """Plain lines when the stream is not a terminal (TRT_DIFFUSION_PROGRESS=plain|off overrides)."""
    choice = os.environ.get("TRT_DIFFUSION_PROGRESS", "").lower()
    if choice in ("plain", "off"):
        return choice == "plain"
    stream = stream or sys.stderr
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):
        return True
