"""The request body cap: an ASGI wrapper that refuses a body past `max_bytes` (413) before it is read whole —
by its Content-Length at once, and by counting what arrives when a client streams or lies about it — and a body
that has not arrived whole within `timeout_s` of the request's start (408): a client trickling its upload cannot
hold a connection and a request slot for ever."""

from __future__ import annotations

import asyncio
import json

from .errors import ApiError


class BodyLimit:
    def __init__(self, app, max_bytes: int, timeout_s: float = 60.0):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"the request body is {size}; this server takes at most {self.max_bytes} bytes "
                             "(--max-body-bytes)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await send_error(send, ApiError(400, f"Content-Length {declared.decode(errors='replace')!r}"
                                                             " is not a number"))
            if int(declared) > self.max_bytes:
                return await send_error(send, self._too_large(f"{int(declared)} bytes"))
        received = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False

        async def counted():
            nonlocal received, body_done
            if body_done:  # later receives wait for a disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
            except TimeoutError:  # raised inside the route's read: its ApiError handler answers
                raise ApiError(408, f"the request body did not arrive whole within {self.timeout_s:g} s; send it "
                                    "at once", code="request_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:  # raised inside the route's read: its ApiError handler answers
                    raise self._too_large(f"more than {self.max_bytes} bytes")
            else:
                body_done = True
            return message

        return await self.app(scope, counted, send)


async def send_error(send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
