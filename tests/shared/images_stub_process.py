"""The stand-in Triton of images_stub_triton.py as a process of its own, so a test can SIGKILL it like a crashed
tritonserver: `python images_stub_process.py --port P --log FILE [--hold-after K | --delay S] [--instances N]`.

It prints `ready URL` once it listens, then logs every inference to FILE as it happens, one tab-separated line each:
`arrived MODEL PROMPT SEED` when one reaches it, `answered MODEL PROMPT SEED` when it has answered. --hold-after K
answers the first K inferences and holds every later one unanswered (until the process dies); --delay S answers
each after S seconds."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from images_stub_triton import start_images_stub  # noqa: E402


class Delay:
    """A gate (the stub takes a permit before it answers) that lets every inference through after `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def acquire(self, timeout: float | None = None) -> bool:
        time.sleep(self.seconds)
        return True

    def release(self, n: int = 1) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--hold-after", type=int)
    parser.add_argument("--delay", type=float)
    parser.add_argument("--instances", type=int, default=2)
    args = parser.parse_args()
    stub = start_images_stub(args.port)
    stub.instances = args.instances
    if args.hold_after is not None:
        stub.gate = threading.Semaphore(args.hold_after)
    elif args.delay is not None:
        stub.gate = Delay(args.delay)
    print("ready", stub.url, flush=True)
    logged = {"arrived": 0, "answered": 0}
    with args.log.open("a") as log:
        while True:
            with stub.lock:
                new = [("arrived", item) for item in stub.arrived[logged["arrived"]:]]
                new += [("answered", item) for item in stub.infers[logged["answered"]:]]
            for kind, (model, prompt, seed) in new:
                log.write(f"{kind}\t{model}\t{prompt}\t{seed}\n")
                logged[kind] += 1
            log.flush()
            time.sleep(0.01)


if __name__ == "__main__":
    main()
