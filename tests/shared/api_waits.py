"""What the OpenAI API's process tests share: waiting for a state with a hang guard, stopping the API process, and an
answer's PNG pixels."""

from __future__ import annotations

import base64
import io
import signal
import subprocess
import time

import numpy as np

GUARD_S = 60  # a step that never happens fails the test instead of hanging it


def until(check, what: str, process: subprocess.Popen | None = None, guard_s: float = GUARD_S):
    """`check()`'s first truthy value (an exception counts as not yet: the API may not listen yet); fails naming
    `what` after `guard_s`, or at once if `process` (the API, or serve) exited, with its stderr where piped."""
    end = time.monotonic() + guard_s
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            said = process.stderr.read().decode()[-2000:] if process.stderr else ""
            raise AssertionError(f"{process.args[:4]} exited ({process.returncode}) while waiting for {what}: {said}")
        try:
            value = check()
        except Exception:  # noqa: BLE001 - not listening yet
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {guard_s} s")


def stop_process(process: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM (the API's own shutdown), then SIGKILL if it is still there after `grace_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()


def png_pixels(b64: str) -> np.ndarray:
    """The RGB pixels of a base64 PNG (an images answer's b64_json)."""
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image.convert("RGB"))
