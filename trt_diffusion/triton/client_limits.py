"""What a Triton client accepts from a server it does not trust: one deadline for a whole exchange, replies
capped before and while they are read, declared sizes bounded before anything is made for them, and one
ServeError for a reply that is not what the protocol says (issue 32, docs/security.md)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from ..errors import ServeError

MAX_RESPONSE_BYTES = 64 << 20  # one reply (an image batch is far smaller)
MAX_SERVED_SIDE = 8192  # a size a server declares (request_sizes) is asked for, and a control image made for it
MAX_INPUT_SIDE = MAX_SERVED_SIDE  # an INIT_IMAGE or MASK the client sends: no bucket is larger


class RequestRejected(ServeError):
    """The server refused the request for load (queue full, or it waited past the queue timeout): retry later."""


class RequestCancelled(ServeError):
    """The request was cancelled, or its deadline passed before the image was ready."""


class ResponseTooLarge(ServeError):
    """A server's reply is larger than the client accepts."""


class _CappedResponse:
    """A geventhttpclient response whose body is read at most `limit` bytes in all, in bounded chunks."""

    def __init__(self, response, url: str, limit: int):
        self._response, self._url, self._limit, self._read = response, url, limit, 0

    def __getattr__(self, name):
        return getattr(self._response, name)

    def read(self, length: int | None = None) -> bytes:
        parts, got = [], 0
        while length is None or got < length:
            chunk = self._response.read(1 << 20 if length is None else min(1 << 20, length - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
            self._read += len(chunk)
            if self._read > self._limit:
                self._response.release()
                raise ResponseTooLarge(f"Triton at {self._url}: the reply is larger than {self._limit} bytes; "
                                       "refusing to read it")
        return b"".join(parts)


def cap_responses(client, url: str, limit: int) -> None:
    """Every reply of this HTTP client checked against `limit`: its declared Content-Length before any body is
    read, and the bytes as they are read (chunked or close-delimited replies declare nothing)."""
    def capped(call):
        def wrapper(*args, **kwargs):
            response = call(*args, **kwargs)
            declared = response.get("content-length")
            try:
                size = int(declared) if declared is not None else None
            except (TypeError, ValueError):
                raise ServeError(f"Triton at {url}: the reply declares Content-Length {declared!r}") from None
            if size is not None and size > limit:
                response.release()
                raise ResponseTooLarge(f"Triton at {url}: the reply declares {size} bytes, more than the {limit} "
                                       "this client reads; refusing it")
            return _CappedResponse(response, url, limit)
        return wrapper

    client._get, client._post = capped(client._get), capped(client._post)


class Deadline:
    """One deadline for a whole command (`generate --timeout`): size discovery, connect and every call are given
    what is left of it (`left()`), on one clock (injectable: tests count time without waiting for it).

    HTTP: `bounded()` also arms a gevent timer for what is left, since the HTTP client's own timeout is per read
    (a server sending a byte a second would hold it forever). gRPC: its blocking calls do not yield to gevent;
    each gets `client_timeout=left()`, its own deadline, which also bounds the channel's connect."""

    def __init__(self, timeout_s: float, url: str, *, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.url, self.clock = timeout_s, url, clock
        self.end = clock() + timeout_s

    def passed(self) -> bool:
        return self.clock() >= self.end

    def left(self, what: str = "the request") -> float:
        """Seconds left, to hand a call as its timeout; RequestCancelled once none are (no call is made then)."""
        left = self.end - self.clock()
        if left <= 0:
            raise self.expired(what)
        return left

    def expired(self, what: str = "the request") -> RequestCancelled:
        return RequestCancelled(f"Triton at {self.url}: no answer within {self.timeout_s:g} s: {what} did not "
                                f"complete within its {self.timeout_s:g} s deadline (--timeout)")

    @contextlib.contextmanager
    def bounded(self, what: str = "the request") -> Iterator[Deadline]:
        """The exchange inside within what is left; a call that failed because the deadline passed (gRPC's
        DEADLINE_EXCEEDED, a connect cut short) says so as the deadline, not as its own error."""
        import gevent

        timer = gevent.Timeout(self.left(what))
        timer.start()
        try:
            yield self
        except gevent.Timeout as exc:
            if exc is not timer:
                raise
            raise self.expired(what) from None
        except Exception as exc:
            if self.passed() and not isinstance(exc, ResponseTooLarge):
                raise self.expired(what) from None
            raise
        finally:
            timer.close()


@contextlib.contextmanager
def deadline(timeout_s: float, url: str, what: str = "the request") -> Iterator[float]:
    """The whole exchange within `timeout_s` (Deadline.bounded). Yields the monotonic time it ends at; gRPC calls
    pass what is left as their own deadline (`remaining`)."""
    with Deadline(timeout_s, url).bounded(what) as bound:
        yield bound.end


def remaining(end: float | None, default: float) -> float:
    return default if end is None else max(0.01, end - time.monotonic())


def malformed(url: str, what: str, exc: Exception) -> ServeError:
    return ServeError(f"Triton at {url}: malformed reply to {what} ({type(exc).__name__}: {str(exc)[:200]})")


def check_served_size(label: str, url: str, pipeline: str) -> None:
    """A size a server declares, before anything is allocated for it: WIDTHxHEIGHT, positive sides <= MAX_SERVED_SIDE."""
    from ..engines_file.engine_spec import Size
    from ..errors import ConfigError

    try:
        size = Size.parse(label)
    except (ConfigError, ValueError, TypeError):
        raise ServeError(f"Triton at {url}: model {pipeline} declares request size {label[:40]!r}, which is not "
                         "WIDTHxHEIGHT") from None
    if not (0 < size.height <= MAX_SERVED_SIDE and 0 < size.width <= MAX_SERVED_SIDE):
        raise ServeError(f"Triton at {url}: model {pipeline} declares request size {label!r}, beyond "
                         f"{MAX_SERVED_SIDE} pixels a side; refusing to make a request (or control image) of it")


def check_input_image(name: str, value, channels: int | None):
    """INIT_IMAGE ([H, W, 3], channels 3) or MASK ([H, W], channels None) as the client sends it: uint8 (never
    cast: a float image in [0, 1] would arrive black), the rank the entry declares, sides in 1..MAX_INPUT_SIDE.
    Whether its size is the request's is the server's to say (it knows the buckets); images are not resized."""
    import numpy as np

    shape = "[H, W, 3]" if channels else "[H, W]"
    if not isinstance(value, np.ndarray):
        raise ServeError(f"{name} must be a numpy uint8 array {shape}, got {type(value).__name__}")
    if value.dtype != np.uint8:
        raise ServeError(f"{name} must be uint8 {shape} (0-255), got {value.dtype}; convert it first (an image "
                         "in [0, 1] is value * 255, rounded)")
    rank_ok = value.ndim == 3 and value.shape[2] == channels if channels else value.ndim == 2
    if not rank_ok:
        raise ServeError(f"{name} must be {shape}, got {list(value.shape)}")
    height, width = value.shape[:2]
    if not (0 < height <= MAX_INPUT_SIDE and 0 < width <= MAX_INPUT_SIDE):
        raise ServeError(f"{name} is {width}x{height}: each side must be 1 to {MAX_INPUT_SIDE} pixels")
    return np.ascontiguousarray(value)
