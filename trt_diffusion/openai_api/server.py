"""The API's HTTP server: uvicorn on 127.0.0.1 by default, in the foreground (`openai-api`) or in a thread beside
tritonserver (`serve --openai-port`)."""

from __future__ import annotations

import threading
import time

from ..errors import ServeError
from .settings import ApiSettings

START_TIMEOUT_S = 30.0


def _config(settings: ApiSettings):
    import uvicorn

    from .app import create_app

    # uvicorn's own limits (docs/security.md): h11 (not httptools, which ignores the header cap) with a cap on the
    # request line and headers, a deadline for them (uvicorn has none: _header_deadline_protocol), idle kept-alive
    # connections closed, and connections beyond a limit answered 503. The body's deadline is the app's (limits.py).
    return uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                          lifespan="on", access_log=False, server_header=False,
                          http=_header_deadline_protocol(settings.header_timeout_s),
                          h11_max_incomplete_event_size=settings.max_header_bytes,
                          timeout_keep_alive=settings.keep_alive_s, limit_concurrency=settings.max_connections)


def _header_deadline_protocol(timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request headers have not arrived whole within `timeout_s`
    of its opening (or of the previous answer on a kept-alive connection). Without it, a socket that sends nothing,
    or a byte now and then, is held for ever (uvicorn's keep-alive timer restarts at every byte)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # nothing was asked: no answer is owed

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in: the body has the app's deadline
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # the next request on this connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadline


def check_port(settings: ApiSettings) -> None:
    import socket

    if settings.port == 0:
        return
    with socket.socket() as sock:
        # as uvicorn binds: a port left in TIME_WAIT by the last run is free, one with a listener is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.host, settings.port))
        except OSError as exc:
            raise ServeError(f"cannot listen on {settings.host}:{settings.port} for the OpenAI API ({exc.strerror}); "
                             "choose another --openai-port") from None


class ApiServer:
    """uvicorn in a daemon thread: start() returns once it listens; stop() ends it."""

    def __init__(self, settings: ApiSettings):
        self.settings = settings.check()
        self._server = None
        self._thread: threading.Thread | None = None
        self.port = settings.port

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}/v1"

    def start(self) -> ApiServer:
        import uvicorn

        check_port(self.settings)
        self._server = uvicorn.Server(_config(self.settings))
        self._thread = threading.Thread(target=self._server.run, name="openai-api", daemon=True)
        self._thread.start()
        end = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise ServeError(f"the OpenAI API did not start on {self.settings.host}:{self.settings.port}")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]  # port 0: the one the OS chose
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(settings: ApiSettings) -> None:
    """Serve in the foreground until Ctrl-C / SIGTERM (uvicorn's own signal handling)."""
    import uvicorn

    settings.check()
    check_port(settings)
    uvicorn.Server(_config(settings)).run()
