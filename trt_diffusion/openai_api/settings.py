"""What the API server is started with: where it listens, which Triton it talks to, its limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ServeError

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # an edit's image and mask travel in the body: 16 MB holds 2048² PNGs
DEFAULT_TIMEOUT_S = 600.0
# a job's call to Triton (a batch line, a video) at most: nobody waits on a job, and a job's request yields to
# people between engine calls (its pauses count against this), so it gets a batch's completion window, 24 h
DEFAULT_JOB_TIMEOUT_S = 24 * 3600.0
# The connection limits (docs/security.md, "Browsers and the API"): a slow or idle socket cannot hold the server.
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a request's headers must arrive whole within this of the connection (or of the
# previous answer on a kept-alive one)
DEFAULT_KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this (uvicorn's timeout_keep_alive)
DEFAULT_BODY_TIMEOUT_S = 60.0  # the whole body within this of the request's start (16 MB: 270 KB/s at least)
DEFAULT_MAX_CONNECTIONS = 128  # open connections and running requests beyond this are answered 503 (uvicorn's
# limit_concurrency); well above the entries' queues (8 by default), so Triton's 429 still speaks first
DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # the request line and headers (h11_max_incomplete_event_size)
DEFAULT_MAX_DECODES = 2  # uploaded images decoded at once (worker threads); more wait their turn
DEFAULT_CATALOG_MAX_AGE_S = 5.0  # the served models are re-read from Triton at most this often
DEFAULT_STATE_MAX_BYTES = 10 * 1024**3  # --state-max-gb 10: the job store's files and results at most
DEFAULT_STATE_RETENTION_S = 7 * 24 * 3600.0  # files and finished batches are deleted a week after they were made
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # Host names always accepted (besides the bind address)


@dataclass(frozen=True)
class ApiSettings:
    # Triton's gRPC address, host:port or grpc://host:port; several, comma-separated: replicas of one model
    # repository, each request sent to one of them (replicas.py)
    triton_url: str
    # each replica's Triton metrics (its Prometheus endpoint: host[:8002] or http://host:port/metrics), in
    # triton_url's order; (): none read, the replicas are loaded by this API's calls in flight alone (replicas.py)
    triton_metrics_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"  # loopback by default: exposing it is a decision (docs/security.md)
    port: int = DEFAULT_PORT
    api_key: str | None = None  # set: every request needs `Authorization: Bearer <key>` (401 otherwise)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S  # one request to Triton at most (queue included)
    job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S  # one job's call to Triton at most (--job-timeout)
    # Browsers (docs/security.md): the Host names a request may carry besides the bind address and loopback's, and
    # the web origins whose pages may call the API (a request with any other Origin header is refused, 403).
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_decodes: int = DEFAULT_MAX_DECODES
    catalog_max_age_s: float = DEFAULT_CATALOG_MAX_AGE_S
    # The job store (batches; docs/deploy.md): None serves no jobs (a library caller's default; the CLI passes
    # job_store.default_state_dir() unless --state-dir names another folder).
    state_dir: Path | None = None
    state_max_bytes: int = DEFAULT_STATE_MAX_BYTES
    state_retention_s: float = DEFAULT_STATE_RETENTION_S
    # Overload policies of online requests, per model (overload.OverloadPolicy; engines.yaml `serving: overload:`),
    # and the cost model that estimates waits (overload.StepCosts when None). Empty: off.
    overload: tuple = ()  # ((model, OverloadPolicy), ...)
    cost_model: object = None

    def check(self) -> ApiSettings:
        problems = []
        if not 0 <= self.port <= 65535:  # 0: any free port (tests)
            problems.append(f"--openai-port must be in 1..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            problems.append(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.timeout_s > 0:
            problems.append(f"--timeout must be positive, got {self.timeout_s}")
        if not self.job_timeout_s > 0:
            problems.append(f"--job-timeout must be positive, got {self.job_timeout_s}")
        if self.api_key is not None and not self.api_key.strip():
            problems.append("--api-key is empty; leave it out to serve without a key")
        problems += triton_url_problems(self.triton_url)
        problems += metrics_url_problems(self.triton_metrics_urls, len(self.triton_urls()))
        for name, value in (("header timeout", self.header_timeout_s), ("keep-alive", self.keep_alive_s),
                            ("body timeout", self.body_timeout_s), ("catalog age", self.catalog_max_age_s)):
            if not value > 0:
                problems.append(f"the {name} must be positive, got {value}")
        for name, value in (("connection limit", self.max_connections), ("header size limit", self.max_header_bytes),
                            ("decode limit", self.max_decodes)):
            if value < 1:
                problems.append(f"the {name} must be at least 1, got {value}")
        if self.state_max_bytes < 1024 * 1024:
            problems.append(f"--state-max-gb must allow at least 1 MiB, got {self.state_max_bytes} bytes")
        if not self.state_retention_s > 0:
            problems.append(f"the job retention must be positive, got {self.state_retention_s}")
        problems += [problem for host in self.allowed_hosts if (problem := host_problem(host))]
        problems += [problem for origin in self.cors_origins if (problem := origin_problem(origin))]
        if problems:
            raise ServeError("; ".join(problems))
        return self

    def triton_urls(self) -> tuple[str, ...]:
        """The replicas' gRPC addresses (one, or several given comma-separated)."""
        return tuple(url.strip() for url in self.triton_url.split(","))

    def replica_metrics_urls(self) -> tuple[str, ...]:
        """Each replica's metrics URL in full (http://host:8002/metrics), in triton_urls()' order; () for none."""
        from .triton_metrics import metrics_url

        return tuple(metrics_url(url) for url in self.triton_metrics_urls)

    def host_names(self) -> frozenset[str]:
        """The Host names a request may carry: loopback's, the bind address (unless a wildcard), --allowed-hosts."""
        names = {*LOOPBACK_HOSTS, *(normal_host(host) for host in self.allowed_hosts)}
        if self.host not in ("0.0.0.0", "::", ""):
            names.add(normal_host(self.host))
        return frozenset(names)

    def origins(self) -> frozenset[str]:
        return frozenset(normal_origin(origin) for origin in self.cors_origins)


def triton_url_problems(value: str) -> list[str]:
    """What is wrong with --triton-url's addresses (comma-separated replicas), each problem naming the option."""
    from ..triton.client import parse_url

    urls = [url.strip() for url in value.split(",")]
    if not any(urls):
        return ["--triton-url is empty; give Triton's gRPC address, e.g. 127.0.0.1:8001"]
    problems = []
    for url in urls:
        if not url:
            problems.append(f"--triton-url {value!r} has an empty address; give each replica's host:port")
            continue
        try:
            address, _ = parse_url(url, "grpc")
        except ServeError as err:
            problems.append(str(err).replace("--url", "--triton-url", 1))
            continue
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in " @,"):
            problems.append(f"--triton-url {url}: not a gRPC address; give host:port (e.g. 127.0.0.1:8001 or "
                            "grpc://triton-0.example.com:8001)")
    seen = [url.split("://")[-1].rstrip("/") for url in urls if url]
    problems += [f"--triton-url {url} is given twice; give each replica once"
                 for url in sorted({url for url in seen if seen.count(url) > 1})]
    return problems


def metrics_url_problems(values: tuple[str, ...], replicas: int) -> list[str]:
    """What is wrong with --triton-metrics-url's addresses: one per --triton-url replica, in its order, or none."""
    from .triton_metrics import metrics_url

    if not values:
        return []
    if len(values) != replicas:
        return [f"--triton-metrics-url gives {len(values)} address{'es' * (len(values) != 1)} for {replicas} "
                f"--triton-url replica{'s' * (replicas != 1)}: give one per replica, in --triton-url's order (or "
                "none: the replicas are then routed by this API's calls in flight alone)"]
    problems, seen = [], []
    for value in values:
        try:
            seen.append(metrics_url(value))
        except ValueError as err:
            problems.append(f"--triton-metrics-url {value!r}: {err}; give HOST[:PORT] (port 8002 by default) or "
                            "http://HOST:PORT/metrics")
    problems += [f"--triton-metrics-url {url} is given twice; give each replica's own"
                 for url in sorted({url for url in seen if seen.count(url) > 1})]
    return problems


def normal_host(host: str) -> str:
    """A host name as Host headers are compared: lower case, without IPv6 brackets or a trailing dot."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.rstrip(".")


def host_problem(host: str) -> str | None:
    text = host.strip()
    if not text or text in ("*", "0.0.0.0", "::") or any(c in text for c in "/@ ,") or "://" in text:
        return (f"--allowed-hosts {host!r} is not a host name: give the name or address clients use, without "
                "scheme, port or path (e.g. images.example.com)")
    bracketed_port = text.startswith("[") and not text.endswith("]")  # [::1]:8080
    if bracketed_port or (":" in text.strip("[]") and not text.startswith("[") and text.count(":") == 1):
        return f"--allowed-hosts {host!r}: give the host without its port (every port of the name is accepted)"
    return None


def normal_origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


def origin_problem(origin: str) -> str | None:
    from urllib.parse import urlsplit

    text = normal_origin(origin)
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query \
            or parts.fragment or parts.username:
        return (f"--cors-origin {origin!r} is not a web origin: give scheme://host[:port] as browsers send it "
                "(e.g. https://app.example.com), one per option")
    return None
