"""How a worker that runs the model on the CPU takes its memory.

By default glibc serves big allocations (activations, logits: megabytes) with fresh mmaps and
gives freed memory back to the kernel, so every step pays page faults and the kernel zeroing
those pages again. Raising both thresholds keeps freed memory in the process for the next step.

The KV cache is the opposite case: gigabytes that must read as zeros. ``torch.zeros`` writes
every byte at start-up (0.45 s a GiB on a quiet 2-core EPYC, several times that under load);
anonymous memory straight from the kernel reads as zeros without being written. Left to fault in
where a block is first written, it made every step that wrote fresh blocks pay for the faults
until the free queue (least recently freed first) had handed out every block once: 2-4% of
workload A's throughput on Xeon-AMX (sessions 31 and 43), in a benchmark and in a server's first
gigabytes of traffic alike. So the worker asks the kernel to back the whole cache at start
(``MADV_POPULATE_WRITE``, Linux 5.14 and later: 0.33 s a GiB, the kernel's zeroing alone), after
checking its size against the memory available: a cache too big for the machine is refused
then, rather than killed for memory once enough blocks are written.

A decode step reads every weight, a walk that crosses a page every 4 KB; on transparent huge
pages (2 MB) it crosses one every 2 MB and runs faster (a plain read of 96 MB: 30.6 GB/s on 4 KB
pages, 37.4 on huge pages, Xeon-AVX512). ``move_weights_to_huge_pages`` moves a loaded model's
weights into one mapping that asks the kernel for them.
"""

import ctypes
import ctypes.util
import errno
import logging
import math
import mmap
from collections.abc import Callable, Iterable

import psutil
import torch
from torch import nn

from strata.worker.kv_cache_sizing import GIB
from strata.worker.tp_layers import QuantizedWeight

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit machines
TRIM_THRESHOLD_BYTES = 1 << 30
HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page
MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14); Python 3.11's mmap does not name it
# Heap memory freed by a move is given back this often, so a move never holds two copies of
# more than this much (``keep_freed_memory`` keeps freed heap memory otherwise).
GIVE_BACK_EVERY_BYTES = 128 << 20
TENSOR_ALIGNMENT = 64  # as torch's CPU allocator aligns, and a cache line


def _c_library_function(name: str) -> Callable[..., int] | None:
    """The C library's function ``name``, or None (logged) where it has none."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError, TypeError):
        logger.debug("no %s in the C library (%s): malloc's behaviour left as it is", name, library)
        return None


def keep_freed_memory() -> bool:
    """Raise malloc's mmap and trim thresholds; returns whether the C library took them."""
    mallopt = _c_library_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Move ``model``'s parameters, buffers and GGUF blocks onto huge pages (``move_to_huge_pages``);
    returns the bytes moved. Run it before anything takes the weights' addresses (the fused
    layers' C structs); the block matrices' own structs are pointed at the new memory here."""
    held = (getattr(module, "quantized", None) for module in model.modules())
    matrices = {id(q.matrix): q.matrix for q in held if isinstance(q, QuantizedWeight)}
    blocks = [part.data for matrix in matrices.values() for part in matrix.parts]
    moved = move_to_huge_pages([*model.parameters(), *model.buffers(), *blocks])
    for matrix in matrices.values():
        matrix.rebind()
    return moved


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy each distinct CPU tensor into one anonymous mapping advised for transparent huge
    pages and point the tensor at its copy in place (``Tensor.set_``: every holder of the tensor
    object sees the new memory; raw addresses taken before do not). The old memory is freed and
    given back to the kernel as the move goes, so at most ``GIVE_BACK_EVERY_BYTES`` are held
    twice. Returns the bytes moved. Where the kernel gives no huge pages
    (``transparent_hugepage`` set to never), the mapping holds ordinary pages."""
    distinct = {id(t): t for t in tensors if t.device.type == "cpu" and t.numel() and t.is_contiguous()}
    if not distinct:
        return 0
    offsets, total = [], 0
    for tensor in distinct.values():
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    # Private: shared anonymous memory is shmem, which takes huge pages only if shmem_enabled says so.
    mapping = mmap.mmap(-1, total + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -arena.data_ptr() % HUGE_PAGE_BYTES  # the huge pages are the aligned 2 MB of the range
    held_twice = 0
    with torch.no_grad():
        for tensor, offset in zip(distinct.values(), offsets):
            nbytes = tensor.numel() * tensor.element_size()
            copy = arena[start + offset : start + offset + nbytes].view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
            tensor.set_(copy)
            held_twice += nbytes
            if held_twice >= GIVE_BACK_EVERY_BYTES:
                _give_back_freed_memory()
                held_twice = 0
    _give_back_freed_memory()
    return total


def _give_back_freed_memory() -> None:
    """Return the free pages of malloc's heap to the kernel (``keep_freed_memory`` keeps them)."""
    malloc_trim = _c_library_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, commit: bool = False) -> torch.Tensor:
    """A CPU tensor of zeros in its own anonymous mapping: with ``commit`` every page is backed
    now, where the kernel can (logged where it cannot), else page by page on first write."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes)
    if commit:
        try:
            mapping.madvise(MADV_POPULATE_WRITE)
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: a kernel before Linux 5.14
                raise ValueError(f"the kernel could not back {num_bytes / GIB:.2f} GiB of KV cache: {error}") from error
            logger.info("the kernel backs the KV cache page by page on first write (MADV_POPULATE_WRITE: %s)", error)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def check_kv_cache_fits(num_bytes: int) -> None:
    """Raise a ValueError when a KV cache of ``num_bytes`` exceeds the memory available now (it
    would otherwise start and be killed for memory once enough blocks were written)."""
    available = psutil.virtual_memory().available
    if num_bytes > available:
        raise ValueError(
            f"the KV cache would take {num_bytes / GIB:.2f} GiB on this rank, more than the "
            f"{available / GIB:.2f} GiB of memory available; lower --kv-cache-memory or --num-gpu-blocks"
        )
