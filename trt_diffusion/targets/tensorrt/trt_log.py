"""TensorRT's log: forwarded to `logging`, recent errors kept so an operation can quote the errors it caused."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # TensorRT's own types (tensorrt-stubs in the test extra)
    import tensorrt as trt

LOG = logging.getLogger("trt_diffusion.targets.tensorrt.engine")  # where TensorRT's messages have always gone


class ErrorLog:
    """The last TensorRT errors, numbered, so one operation can quote the errors it caused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._errors: deque[tuple[int, str]] = deque(maxlen=50)

    def add(self, message: str) -> None:
        with self._lock:
            self._errors.append((self._count, message))
            self._count += 1

    def mark(self) -> int:
        with self._lock:
            return self._count

    def since(self, mark: int) -> list[str]:
        with self._lock:
            return [message for index, message in self._errors if index >= mark]


ERRORS = ErrorLog()
_LOGGER_LOCK = threading.Lock()
_LOGGER: trt.ILogger | None = None


def _make_logger() -> trt.ILogger:
    import tensorrt as trt

    severity = trt.ILogger.Severity
    levels = {
        severity.INTERNAL_ERROR: logging.CRITICAL,
        severity.ERROR: logging.ERROR,
        severity.WARNING: logging.WARNING,
        severity.INFO: logging.INFO,
        severity.VERBOSE: logging.DEBUG,
    }
    errors = (severity.INTERNAL_ERROR, severity.ERROR)

    class RecordingLogger(trt.ILogger):
        """TensorRT calls this from its own threads: it must be thread-safe and must not raise."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            try:
                if severity in errors:
                    ERRORS.add(msg)
                python_level = levels.get(severity, logging.DEBUG)
                if LOG.isEnabledFor(python_level):
                    LOG.log(python_level, "TensorRT: %s", msg)
            except Exception:  # noqa: BLE001 - an exception must not cross into TensorRT
                pass

    return RecordingLogger()


def trt_logger() -> trt.ILogger:
    """One logger for the process: TensorRT treats the first logger it is given as the global one."""
    import tensorrt as trt

    global _LOGGER
    with _LOGGER_LOCK:
        if _LOGGER is None:
            _LOGGER = _make_logger()
            trt.init_libnvinfer_plugins(_LOGGER, "")
        return _LOGGER


def with_trt_errors(message: str, mark: int) -> str:
    said = ERRORS.since(mark)
    return message + ("\nTensorRT said:\n  " + "\n  ".join(said) if said else "")


def parser_error_text(error: trt.ParserError) -> str:
    """One ONNX parser error, with its node where the binding says."""
    try:
        node = f" (node {error.node_name() or error.node()}, {error.node_operator()})" if error.node() >= 0 else ""
        return f"{error.desc()}{node}"
    except Exception:  # noqa: BLE001 - older bindings lack some accessors; str() always works
        return str(error)
