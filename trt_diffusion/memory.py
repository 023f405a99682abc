"""Hand memory back between the stages of a full-size job, so each step's peak is its own."""

from __future__ import annotations

import gc


def release_memory() -> None:
    """Collect garbage (modules hold reference cycles) and hand freed heap pages back to the OS.

    glibc keeps freed blocks below its mmap threshold in its arenas, so without `malloc_trim` a freed
    module can keep counting toward RSS while the next step allocates anew.
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass
