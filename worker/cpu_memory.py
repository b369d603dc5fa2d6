"""glibc malloc settings for a worker that runs the model on the CPU (a no-op elsewhere).

By default glibc serves big allocations (activations, logits: megabytes) with fresh mmaps and
gives freed memory back to the kernel, so every step pays page faults and the kernel zeroing
those pages again. Raising both thresholds keeps freed memory in the process for the next step.
"""

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit machines
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Raise malloc's mmap and trim thresholds; returns whether the C library took them."""
    library = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(library).mallopt
    except (OSError, AttributeError, TypeError):
        logger.debug("no mallopt in the C library (%s): malloc settings left as they are", library)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
