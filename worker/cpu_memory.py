"""How a worker that runs the model on the CPU takes its memory.

By default glibc serves big allocations (activations, logits: megabytes) with fresh mmaps and
gives freed memory back to the kernel, so every step pays page faults and the kernel zeroing
those pages again. Raising both thresholds keeps freed memory in the process for the next step.

The KV cache is the opposite case: gigabytes that must read as zeros, most of them untouched
for a long time. ``torch.zeros`` writes every byte at start-up (0.45 s a GiB on a quiet 2-core
EPYC, several times that under load);
anonymous memory straight from the kernel reads as zeros and costs a page fault only where a
block is first written. Since the kernel commits that memory only then, the cache's size is
checked against the memory available at start-up instead.
"""

import ctypes
import ctypes.util
import logging
import math
import mmap

import psutil
import torch

from strata.worker.kv_cache_sizing import GIB

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


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in its own anonymous mapping, paid for page by page on first write."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=dtype).view(shape)


def check_kv_cache_fits(num_bytes: int) -> None:
    """Raise a ValueError when a KV cache of ``num_bytes`` exceeds the memory available now (it
    would otherwise start and be killed for memory once enough blocks were written)."""
    available = psutil.virtual_memory().available
    if num_bytes > available:
        raise ValueError(
            f"the KV cache would take {num_bytes / GIB:.2f} GiB on this rank, more than the "
            f"{available / GIB:.2f} GiB of memory available; lower --kv-cache-memory or --num-gpu-blocks"
        )
