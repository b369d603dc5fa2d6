"""What a worker needs to know to build its model runner; sent to worker processes as msgpack.

Also the values its string settings accept, here rather than beside the code that reads them
so that the engine flags can offer them as choices without importing torch."""

import msgspec

from strata.engine_core.zmq_curve import WorkerCurveKeys

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = (*DTYPES, "fp8")  # fp8: float8 e4m3 (worker.attention.kv_cache_dtype)
CPU_BF16_LINEAR_MODES = ("auto", "float32", "native")
QUANTIZATIONS = ("auto", "gguf", "fp8", "fp8-weight-only", "int8", "none")
ATTENTION_BACKENDS = ("torch", "cpu", "triton")


class WorkerConfig(msgspec.Struct):
    """One rank's configuration. ``model`` is a local HF-style directory (already resolved).
    KV-cache size: ``num_gpu_blocks`` if set, else ``kv_cache_memory`` bytes per rank, else on
    CUDA what a profile run leaves of ``gpu_memory_utilization`` of the GPU, on CPU 1 GiB."""

    model: str
    load_format: str = "auto"  # "dummy": random weights of the config's shapes
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    cpu_bf16_linear: str = "auto"  # how a bfloat16 model's linears run on CPU
    quantization: str = "auto"  # gguf: model_loader.quantized_weights_file; fp8, int8: scaled_weights.scaled_scheme
    gguf_file: str | None = None  # the GGUF file `model` was converted from, if any
    device: str = "cpu"
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA, when neither of the two above is set
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    cuda_graph_sizes: list[int] | None = None  # padded decode batch sizes to capture; None: a default ladder
    attention_backend: str | None = None
    kv_offload_cpu_bytes: int | None = None  # CPU tier, total over all ranks
    kv_offload_block_size: int | None = None  # tokens per CPU block, a multiple of block_size
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: list[int] | None = None  # decoder layers per stage; None: balanced
    rank: int = 0  # global: pipeline stage * tensor_parallel_size + tensor-parallel rank
    distributed_init_method: str = ""
    # LoRA: a pool of ``max_loras`` adapter slots of rank up to ``max_lora_rank`` in each
    # targeted linear; up to ``max_cpu_loras`` adapters kept in CPU memory to swap in from.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # Speculative decoding with a draft model (its resolved directory, and the GGUF file it was
    # converted from, if any; its first ``speculative_draft_layers`` layers if set), run
    # ``num_speculative_tokens`` times per decoding row after each step.
    speculative_model: str | None = None
    speculative_gguf_file: str | None = None
    speculative_draft_layers: int | None = None
    num_speculative_tokens: int = 3


class WorkerProcessConfig(msgspec.Struct):
    """What a worker process reads on its stdin: its rank's config and the executor's sockets."""

    worker: WorkerConfig
    step_endpoint: str  # the executor binds a PUSH socket per rank here
    result_endpoint: str  # the executor's PULL socket, shared by all ranks
    curve: WorkerCurveKeys | None = None  # CurveZMQ keys, for TCP endpoints
