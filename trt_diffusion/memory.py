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


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
LARGE_BLOCK = 1 << 20


def return_large_blocks_to_os() -> None:
    """Serve every allocation of 1 MiB or more from its own mmap, returned to the OS when freed.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), so the weight-sized
    temporaries a runtime makes and frees call after call (a transposed or packed MatMul weight) then come from the
    heap and stay resident: the ONNX Runtime check of the 1.3B Wan transformer peaked at 12.96 GiB (2.45× its fp32
    weights) that way, and at 7.52 GiB with the threshold fixed. Setting it also turns glibc's adjustment off.
    Process-wide and harmless elsewhere (a few more mmap calls); a no-op off glibc.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK)
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        pass
