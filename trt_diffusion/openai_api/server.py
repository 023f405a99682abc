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

    return uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                          lifespan="on", access_log=False, server_header=False)


def check_port(settings: ApiSettings) -> None:
    import socket

    if settings.port == 0:
        return
    with socket.socket() as sock:
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
