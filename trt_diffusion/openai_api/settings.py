"""What the API server is started with: where it listens, which Triton it talks to, its limits."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ServeError

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # an edit's image and mask travel in the body: 16 MB holds 2048² PNGs
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ApiSettings:
    triton_url: str  # Triton's gRPC address, host:port or grpc://host:port
    host: str = "127.0.0.1"  # loopback by default: exposing it is a decision (docs/security.md)
    port: int = DEFAULT_PORT
    api_key: str | None = None  # set: every request needs `Authorization: Bearer <key>` (401 otherwise)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S  # one request to Triton at most (queue included)

    def check(self) -> ApiSettings:
        problems = []
        if not 0 <= self.port <= 65535:  # 0: any free port (tests)
            problems.append(f"--openai-port must be in 1..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            problems.append(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.timeout_s > 0:
            problems.append(f"--timeout must be positive, got {self.timeout_s}")
        if self.api_key is not None and not self.api_key.strip():
            problems.append("--api-key is empty; leave it out to serve without a key")
        if not self.triton_url.strip():
            problems.append("--triton-url is empty; give Triton's gRPC address, e.g. 127.0.0.1:8001")
        else:
            from ..triton.client import parse_url

            try:
                parse_url(self.triton_url, "grpc")
            except ServeError as err:
                problems.append(str(err).replace("--url", "--triton-url", 1))
        if problems:
            raise ServeError("; ".join(problems))
        return self
