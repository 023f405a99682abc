"""A Triton replica's queue as the API front reads it (replicas.py): Triton's Prometheus endpoint (its metrics port,
8002 by default, `/metrics`), fetched and parsed here with the standard library (prometheus_client is not a
dependency of the project, and the text format's sample lines are all that is needed).

The queue is Triton's `nv_inference_pending_request_count`: per model (and version), the requests waiting in its
scheduler's queue for an instance, a gauge read as it is now. Summed over the replica's models: they share its GPU
(an image entry, its stream model for videos, the engine models its BLS calls queue on), so what waits for any of
them waits for that replica's hardware. The other `nv_inference_*` families are counters of what has run
(`nv_inference_exec_count`, `nv_inference_queue_duration_us`, ...): not what is waiting now."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

PENDING = "nv_inference_pending_request_count"
DEFAULT_PORT = 8002  # tritonserver's --metrics-port default
PATH = "/metrics"
MAX_BYTES = 8 * 1024 * 1024  # a real replica's body is ~10 KB per few models; a larger answer is not Triton's


class MetricsError(ValueError):
    """A metrics body that does not say a replica's queue (not Prometheus text, or without PENDING)."""


def metrics_url(value: str) -> str:
    """The full URL of a replica's metrics: `HOST`, `HOST:PORT`, `http(s)://HOST[:PORT][/PATH]`; the port defaults to
    8002 and the path to /metrics. ValueError naming what is wrong (the caller names its option)."""
    text = value.strip()
    if not text:
        raise ValueError("an empty address")
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError("not a host[:port] or http(s)://host[:port][/path]") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"unknown scheme {parts.scheme}:// (Triton's metrics are http:// or https://)")
    if not parts.hostname or parts.username or parts.query or parts.fragment or " " in text:
        raise ValueError("not a host[:port] or http(s)://host[:port][/path]")
    if port == 0:
        raise ValueError("port 0")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port or DEFAULT_PORT}{parts.path.rstrip('/') or PATH}"


def fetch(url: str, timeout_s: float) -> str:
    """The body of `url` (blocking: run it in a worker thread). OSError (urllib's URLError included) when the
    replica does not answer or answers an HTTP error; MetricsError when the body is over MAX_BYTES."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http(s) only (metrics_url)
        body = response.read(MAX_BYTES + 1)
    if len(body) > MAX_BYTES:
        raise MetricsError(f"the answer is over {MAX_BYTES // (1024 * 1024)} MiB: not Triton's metrics")
    return body.decode("utf-8", "replace")


def read_queue(url: str, timeout_s: float) -> int:
    """The requests waiting in the replica whose metrics are at `url`, all its models summed (blocking, the parse
    included: run it in a worker thread). OSError or MetricsError as fetch and pending_requests raise them."""
    return sum(pending_requests(fetch(url, timeout_s)).values())


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each sample of a Prometheus text exposition: (name, labels, value); comments and blank lines skipped, an
    optional timestamp ignored. MetricsError on a line that is not a sample."""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            yield _sample(line)
        except (ValueError, IndexError):
            raise MetricsError(f"line {number} is not a Prometheus sample: {line[:120]!r}") from None


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    brace = line.find("{")
    space = line.find(" ")
    labels: dict[str, str] = {}
    if brace != -1 and (space == -1 or brace < space):
        name, rest = line[:brace], line[brace + 1:]
        while True:
            rest = rest.lstrip()
            if rest.startswith("}"):
                rest = rest[1:]
                break
            key, _, rest = rest.partition("=")
            if not rest.startswith('"'):
                raise ValueError(line)
            value, rest = _quoted(rest[1:])
            labels[key.strip()] = value
            rest = rest.lstrip()
            if rest.startswith(","):
                rest = rest[1:]
            elif not rest.startswith("}"):
                raise ValueError(line)
    else:
        name, _, rest = line.partition(" ")
    fields = rest.split()
    if not name or not 1 <= len(fields) <= 2:
        raise ValueError(line)
    return name, labels, float(fields[0])  # float() reads +Inf, -Inf and NaN as the format writes them


def _quoted(text: str) -> tuple[str, str]:
    """A label value after its opening quote: (the value unescaped, the text after its closing quote)."""
    out = []
    index = 0
    while True:
        char = text[index]  # IndexError: no closing quote
        if char == '"':
            return "".join(out), text[index + 1:]
        if char == "\\":
            index += 1
            out.append({"n": "\n"}.get(text[index], text[index]))  # \\ \" \n
        else:
            out.append(char)
        index += 1


def pending_requests(text: str) -> dict[str, int]:
    """Requests waiting per model (its versions summed) in a Triton metrics body. MetricsError when the body has no
    PENDING family (not Triton's metrics, or a Triton that does not report its queues)."""
    pending: dict[str, int] = {}
    found = False
    for name, labels, value in samples(text):
        if name != PENDING:
            continue
        found = True
        if math.isfinite(value):
            model = labels.get("model", "")
            pending[model] = pending.get(model, 0) + max(0, int(value))
    if not found:
        raise MetricsError(f"no {PENDING} in the answer: not Triton's metrics, or a Triton that does not report "
                           "its queues")
    return pending
