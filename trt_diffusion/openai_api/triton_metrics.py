"""A Triton replica's queue as the API front reads it (replicas.py): Triton's Prometheus endpoint (its metrics port,
8002 by default, `/metrics`), fetched with the standard library and parsed by prometheus_client's text parser.

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
    """Each sample of a Prometheus text exposition: (name, labels, value), through prometheus_client's parser.
    MetricsError when the text is not that format."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                yield sample.name, dict(sample.labels), float(sample.value)
    except ValueError as exc:  # the parser's error for a line it cannot read
        raise MetricsError(f"not Prometheus text: {str(exc)[:160]}") from None


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
