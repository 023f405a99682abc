"""The request body cap: an ASGI wrapper that refuses a body past `max_bytes` (413) before it is read whole —
by its Content-Length at once, and by counting what arrives when a client streams or lies about it."""

from __future__ import annotations

import json

from .errors import ApiError


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"the request body is {size}; this server takes at most {self.max_bytes} bytes "
                             "(--max-body-bytes)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _send_error(send, ApiError(400, f"Content-Length {declared.decode(errors='replace')!r}"
                                                             " is not a number"))
            if int(declared) > self.max_bytes:
                return await _send_error(send, self._too_large(f"{int(declared)} bytes"))
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # raised inside the route's read: its ApiError handler answers
                    raise self._too_large(f"more than {self.max_bytes} bytes")
            return message

        return await self.app(scope, counted, send)


async def _send_error(send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
