"""What a worker needs to know to build its model runner; sent to worker processes as msgpack."""

import msgspec


class WorkerConfig(msgspec.Struct):
    """One rank's configuration. ``model`` is a local HF-style directory (already resolved).
    KV-cache size: ``num_gpu_blocks`` if set, else ``kv_cache_memory`` bytes per rank, else a
    device default."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    attention_backend: str | None = None
    kv_offload_cpu_bytes: int | None = None  # CPU tier, total over all ranks
    kv_offload_block_size: int | None = None  # tokens per CPU block, a multiple of block_size
    tensor_parallel_size: int = 1
    rank: int = 0
    distributed_init_method: str = ""
