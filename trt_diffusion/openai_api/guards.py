"""What keeps a web page from driving the API (docs/security.md, "Browsers and the API"), as an ASGI wrapper around
every route:

- `Host` must name this server: the bind address, loopback's names, or one given with --allowed-hosts (403 else).
  A DNS-rebinding page reaches 127.0.0.1 under its own domain name, which it cannot hide from this header.
- A request that carries an `Origin` header (browsers add it to every cross-site request and to every POST) must
  come from an origin named with --cors-origin (403 else); those get CORS answers, preflights included.

Both are checked before the key, the body or the route: a refused request costs nothing else."""

from __future__ import annotations

from .errors import ApiError
from .limits import send_error
from .settings import ApiSettings, normal_host, normal_origin

# DELETE: videos.delete (DELETE /v1/videos/{id})
PREFLIGHT_HEADERS = [(b"access-control-allow-methods", b"GET, POST, DELETE"),
                     (b"access-control-allow-headers", b"authorization, content-type"),
                     (b"access-control-max-age", b"600")]


def _host_name(value: str) -> str:
    """The name of a Host header, its port dropped ("[::1]:8080" -> "::1", "example.com:80" -> "example.com")."""
    if value.startswith("["):
        return normal_host(value.partition("]")[0] + "]")
    name, _, port = value.rpartition(":")
    return normal_host(name if name and port.isdigit() and ":" not in name else value)


class BrowserGuard:
    def __init__(self, app, settings: ApiSettings):
        self.app = app
        self.hosts = settings.host_names()
        self.origins = settings.origins()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = [(name.lower(), value) for name, value in scope.get("headers") or []]
        hosts = [value.decode("latin-1").strip() for name, value in headers if name == b"host"]
        if len(hosts) != 1 or _host_name(hosts[0]) not in self.hosts:
            shown = repr(hosts[0]) if len(hosts) == 1 else f"{len(hosts)} Host headers"
            return await send_error(send, ApiError(
                403, f"Host {shown} is not this server's name: requests must name it as the address it listens on, "
                     "localhost or 127.0.0.1 (serve other names with --allowed-hosts)", code="host_not_allowed"))
        origins = [value.decode("latin-1").strip() for name, value in headers if name == b"origin"]
        if not origins:
            return await self.app(scope, receive, send)
        origin = origins[0]
        if len(origins) != 1 or normal_origin(origin) not in self.origins:
            return await send_error(send, ApiError(
                403, f"Origin {origin!r} may not call this API: a web page can call it only from an origin named "
                     "with --cors-origin", code="origin_not_allowed"))
        allow = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        request_headers = dict(headers)
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in request_headers:
            await send({"type": "http.response.start", "status": 204, "headers": allow + PREFLIGHT_HEADERS})
            return await send({"type": "http.response.body", "body": b""})

        async def with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *allow]}
            await send(message)

        return await self.app(scope, receive, with_cors)
