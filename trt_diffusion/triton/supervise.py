"""`serve --replicas N` (N > 1) keeps its replicas up: a tritonserver that exits while serving is started again on
its own ports and work folder, so the API in front (openai_api/replicas.py) sees it lost, then probes it back.

RestartPolicy decides, with no clock of its own (told how long the replica ran before it exited): the pause before
the next start (1 s, doubling, at most 30 s) or giving up. A replica whose engines cannot load, whose port another
process took, or that crashes at its first request would otherwise be restarted for ever: after
`max_quick_restarts` quick failures in a row — an exit within `stable_s` of being ready, or a start that failed —
the next one gives up, and serve stops every replica and exits 1 naming it, as when a replica fails to start.
A replica that ran `stable_s` or longer before it exited has recovered: its count starts again.

`supervise` is the loop around it: it watches the servers, logs each exit (the replica, its exit code, the pause)
and each restart, restarts through TritonServer.restart, and returns only by raising (a stop signal's
KeyboardInterrupt, or ServeError when a replica is given up on). One replica's restart blocks the loop: another
that exits meanwhile is seen once it is done."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from ..errors import ServeError

log = logging.getLogger("trt_diffusion.triton.serve")
POLL_S = 0.5  # how often the servers are looked at


@dataclass
class RestartPolicy:
    max_quick_restarts: int = 3
    stable_s: float = 60.0  # a replica up this long before it exited starts its count again
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    quick_failures: int = 0  # exits within stable_s of being ready, or failed starts, in a row

    def after_exit(self, up_s: float) -> float | None:
        """The replica exited `up_s` seconds after it was ready (a failed start: after it was started): seconds to
        wait before starting it again, or None to give up."""
        if up_s >= self.stable_s:
            self.quick_failures = 0
        self.quick_failures += 1
        if self.quick_failures > self.max_quick_restarts:
            return None
        return min(self.backoff_s * 2 ** (self.quick_failures - 1), self.max_backoff_s)


def supervise(servers: Sequence, ready_timeout_s: float, *, policy: Callable[[], RestartPolicy] = RestartPolicy,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> NoReturn:
    """Watch `servers` (TritonServer: is_alive, process.returncode, restart, log_tail) until a stop signal
    (KeyboardInterrupt, raised through) or a replica given up on (ServeError naming it with its log tail)."""
    count = len(servers)
    policies = [policy() for _ in servers]
    started = [clock()] * count
    while True:
        sleep(POLL_S)
        for index, server in enumerate(servers):
            name = f"replica {index + 1} of {count}"
            while not server.is_alive():
                code = server.process.returncode
                pause = policies[index].after_exit(clock() - started[index])
                if pause is None:
                    raise ServeError(f"tritonserver exited unexpectedly with {code} ({name}; given up after "
                                     f"{policies[index].max_quick_restarts} restarts, each failing within "
                                     f"{policies[index].stable_s:.0f} s; the others are stopped):\n"
                                     f"{server.log_tail()}")
                log.warning("%s: tritonserver exited with %s; restarting it on its ports in %.0f s (restart %d of at "
                            "most %d in a row)", name, code, pause, policies[index].quick_failures,
                            policies[index].max_quick_restarts)
                sleep(pause)
                started[index] = clock()
                try:
                    seconds = server.restart(ready_timeout_s)
                except ServeError as err:
                    log.warning("%s: the restart failed: %s", name, str(err).splitlines()[0])
                    continue
                started[index] = clock()
                log.warning("%s: restarted, ready in %.1f s (%s)", name, seconds, server.log_path)
