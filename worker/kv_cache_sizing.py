"""How many bytes of a GPU the KV cache may take, from what a profile run measured.

The arithmetic is a pure function of the measured numbers so that it is tested without a GPU;
the model runner measures them (``ModelRunner._profile_device_memory``).
"""

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU's memory as the profile run saw it, in bytes.

    ``peak_activations``: the most the largest step (``max_num_batched_tokens`` tokens, sampler
    at ``max_num_seqs`` rows) allocated on top of the weights. ``cuda_graphs``: what the graph
    pool is expected to hold. ``non_torch``: memory in use that torch's allocator does not own
    (CUDA context, NCCL buffers, other processes on the same GPU).
    """

    total: int
    weights: int
    peak_activations: int
    cuda_graphs: int
    non_torch: int


def kv_cache_bytes(memory: DeviceMemory, gpu_memory_utilization: float) -> int:
    """``gpu_memory_utilization`` of the device minus everything else the engine needs there.

    Raises a ValueError naming every term when nothing is left for the cache.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    usable = int(memory.total * gpu_memory_utilization)
    needed = memory.weights + memory.peak_activations + memory.cuda_graphs + memory.non_torch
    budget = usable - needed
    if budget <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {gpu_memory_utilization} x {_gib(memory.total)} = "
            f"{_gib(usable)} usable, but the weights take {_gib(memory.weights)}, the largest step's "
            f"activations {_gib(memory.peak_activations)}, CUDA graphs {_gib(memory.cuda_graphs)} and "
            f"memory outside torch {_gib(memory.non_torch)}; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens / --max-num-seqs"
        )
    return budget


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
