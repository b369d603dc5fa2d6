"""The engine flags shared by ``generate``, ``serve`` and ``bench``, and what they resolve to."""

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.scheduler import SchedulerConfig
from strata.runtime.executors.ray_config import RAY_PLACEMENT_STRATEGIES, RayConfig
from strata.worker.config import WorkerConfig

DEFAULT_MAX_MODEL_LEN_CAP = 8192
LOAD_FORMATS = ("auto", "dummy")  # as worker.model_loader.LOAD_FORMATS, without importing torch here
CPU_BF16_LINEAR_MODES = ("auto", "float32", "native")  # as worker.model_loader's
DP_ROUTING_POLICIES = ("cache-aware", "least-loaded", "round-robin")


@dataclass
class EngineArgs:
    """Everything a user can set about the engine. ``model=None`` is the default model."""

    model: str | None = None
    load_format: str = "auto"
    tokenizer: str | None = None
    skip_tokenizer: bool = False
    dtype: str = "auto"
    cpu_bf16_linear: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    executor: str = "mp"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    worker_timeout_s: float = 60.0
    kv_offload_cpu_bytes: int | None = None
    kv_offload_policy: str = "lru"
    kv_offload_block_size: int | None = None
    ray_address: str | None = None
    ray_placement_strategy: str = "PACK"
    ray_placement_timeout_s: float = 60.0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    data_parallel_size: int = 1
    dp_routing: str = "cache-aware"
    dp_load_margin: int = 2048
    dp_router_max_hashes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.executor not in ("uni", "mp", "ray"):
            raise ValueError(f"executor must be 'uni', 'mp' or 'ray', got {self.executor!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.executor == "uni" and self.tensor_parallel_size != 1:
            raise ValueError("the uni executor runs one rank: use --executor mp for tensor parallelism")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ray_placement_strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                f"got {self.ray_placement_strategy!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.cpu_bf16_linear not in CPU_BF16_LINEAR_MODES:
            raise ValueError(
                f"cpu_bf16_linear must be one of {', '.join(CPU_BF16_LINEAR_MODES)}, got {self.cpu_bf16_linear!r}"
            )
        if self.skip_tokenizer and self.tokenizer is not None:
            raise ValueError("tokenizer and skip_tokenizer exclude each other")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graph_sizes is not None and not all(1 <= size <= self.max_num_seqs for size in self.cuda_graph_sizes):
            raise ValueError(
                f"cuda_graph_sizes must lie in 1..max_num_seqs ({self.max_num_seqs}), got {self.cuda_graph_sizes}"
            )
        if self.ray_placement_timeout_s <= 0:
            raise ValueError(f"ray_placement_timeout_s must be > 0, got {self.ray_placement_timeout_s}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.executor == "uni" and self.data_parallel_size != 1:
            raise ValueError("the uni executor runs one replica: use --executor mp or ray for data parallelism")
        if self.executor == "ray" and self.data_parallel_size > 1 and not (self.ray_address or os.environ.get("RAY_ADDRESS")):
            raise ValueError(
                "data parallelism on Ray needs a running cluster that every replica joins: start one "
                "(strata launch ray --head) and pass --ray-address or set RAY_ADDRESS"
            )
        if self.dp_routing not in DP_ROUTING_POLICIES:
            raise ValueError(f"dp_routing must be one of {', '.join(DP_ROUTING_POLICIES)}, got {self.dp_routing!r}")
        if self.dp_load_margin < 0:
            raise ValueError(f"dp_load_margin must be >= 0, got {self.dp_load_margin}")
        if self.dp_router_max_hashes < 1:
            raise ValueError(f"dp_router_max_hashes must be >= 1, got {self.dp_router_max_hashes}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a tcp:// or ipc:// endpoint, got {endpoint!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--model", default=None, help="HF directory, .gguf file, config.json or gemma3-270m (default: SmolLM2-135M-Instruct)")
        add("--load-format", default="auto", choices=LOAD_FORMATS, help="dummy: seeded random weights of the config's shapes")
        add("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        add("--skip-tokenizer", action="store_true", help="no tokenizer: token-id prompts only, no output text")
        add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        add("--cpu-bf16-linear", default="auto", choices=CPU_BF16_LINEAR_MODES,
            help="a bfloat16 model on CPU: float32 runs its linears as float32 GEMMs on the bfloat16 weights "
            "(2x their memory), native as bfloat16 GEMMs; auto: float32 where the CPU lacks native bfloat16")
        add("--device", default="auto", help="cpu, cuda, cuda:K (mp ranks take cuda:K, cuda:K+1, ...) or auto")
        add("--tensor-parallel-size", "-tp", type=int, default=1)
        add("--executor", default="mp", choices=["uni", "mp", "ray"], help="uni: one process (debugging)")
        add("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
        add("--max-num-seqs", type=int, default=256, help="most requests in one step")
        add("--max-model-len", type=int, default=None, help="default: the model's, capped at 8192")
        add("--block-size", type=int, default=16)
        add("--kv-cache-memory", type=int, default=None, help="KV-cache bytes per rank")
        add("--num-gpu-blocks", type=int, default=None, help="KV-cache blocks (overrides --kv-cache-memory)")
        add("--gpu-memory-utilization", type=float, default=0.9, help="CUDA: share of the GPU for weights, activations, graphs and KV cache")
        add("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
        add("--cuda-graph-sizes", type=_int_list, default=None, help="CUDA: decode batch sizes to capture, e.g. 1,2,4,8 (default 1,2,4,8,16,...,max-num-seqs)")
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        add("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
        add("--attention-backend", default=None, choices=["torch", "cpu", "triton"])
        add("--worker-timeout-s", type=float, default=60.0, help="a worker silent this long is declared hung")
        add("--kv-offload-cpu-bytes", type=int, default=None, help="CPU KV tier size, total over TP ranks (off by default)")
        add("--kv-offload-policy", default="lru", choices=["lru", "arc"], help="CPU tier eviction policy")
        add("--kv-offload-block-size", type=int, default=None, help="tokens per CPU block (a multiple of --block-size)")
        add("--ray-address", default=None, help="ray: head host:port (default $RAY_ADDRESS, else a local cluster)")
        add("--ray-placement-strategy", default="PACK", choices=RAY_PLACEMENT_STRATEGIES, help="ray: rank layout")
        add("--ray-placement-timeout-s", type=float, default=60.0, help="ray: fail if the ranks are not placed by then")
        add("--kv-events-endpoint", default=None,
            help="publish KV events on this ZeroMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 (off by default)")
        add("--kv-events-replay-endpoint", default=None,
            help="replay socket for missed KV-event batches (default: the next TCP port, or PATH-replay)")
        add("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas, each with its own TP workers")
        add("--dp-routing", default="cache-aware", choices=DP_ROUTING_POLICIES, help="how requests pick a replica")
        add("--dp-load-margin", type=int, default=2048,
            help="cache-aware: tokens of extra load a prefix hit may cost before least-loaded wins")
        add("--dp-router-max-hashes", type=int, default=1 << 20, help="cache-aware: block hashes the router remembers")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in vars(args).items() if name in names})


@dataclass
class ResolvedConfig:
    """What a frontend needs to start an engine, derived from ``EngineArgs`` and the model."""

    model_path: Path
    tokenizer_path: Path | None  # None: --skip-tokenizer
    scheduler: SchedulerConfig
    worker: WorkerConfig
    executor: str = "mp"
    worker_timeout_s: float = 60.0
    ray: RayConfig | None = None  # for --executor ray only
    kv_offload_policy: str = "lru"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    def make_connector(self, num_cpu_blocks: int) -> SchedulerConnector | None:
        return make_offload_connector(self.scheduler, self.worker, self.kv_offload_policy, num_cpu_blocks)


def make_offload_connector(
    scheduler: SchedulerConfig, worker: WorkerConfig, policy: str, num_cpu_blocks: int
) -> SchedulerConnector | None:
    """The scheduler side of the CPU offload tier, if the workers made one (``num_cpu_blocks``)."""
    if not num_cpu_blocks:
        return None
    from strata.connector.offloading_scheduler import OffloadingConnectorScheduler

    offload_block_size = worker.kv_offload_block_size or scheduler.block_size
    return OffloadingConnectorScheduler(scheduler.block_size, offload_block_size, num_cpu_blocks, policy)


def tokenizer_json_path(model_dir: str) -> str | None:
    """The model's fast-tokenizer file, which the EngineCore compiles grammars against."""
    path = Path(model_dir) / "tokenizer.json"
    return str(path) if path.is_file() else None


def resolve(args: EngineArgs) -> ResolvedConfig:
    """Locate the model (converting the default GGUF once) and derive every config from it."""
    # torch-heavy: only when actually building
    from strata.worker.model_loader import resolve_model_path
    from strata.worker.model_registry import model_class

    path = resolve_model_path(args.model)
    model_config = json.loads((path / "config.json").read_text())
    model_class(model_config.get("model_type", ""), model_config.get("architectures"))  # fail before any process starts
    model_max = int(model_config.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN_CAP))
    if args.max_model_len is None:
        max_model_len = min(model_max, DEFAULT_MAX_MODEL_LEN_CAP)
    elif args.max_model_len > model_max:
        raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's {model_max}")
    else:
        max_model_len = args.max_model_len
    scheduler = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        block_size=args.block_size,
        policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    worker = WorkerConfig(
        model=str(path),
        load_format=args.load_format,
        dtype=args.dtype,
        cpu_bf16_linear=args.cpu_bf16_linear,
        device=_device(args.device),
        block_size=args.block_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_offload_cpu_bytes=args.kv_offload_cpu_bytes,
        kv_offload_block_size=args.kv_offload_block_size,
    )
    ray_config = None
    if args.executor == "ray":
        ray_config = RayConfig(args.ray_address, args.ray_placement_strategy, args.ray_placement_timeout_s)
    return ResolvedConfig(
        path, _tokenizer_path(args, path), scheduler, worker, args.executor, args.worker_timeout_s, ray_config,
        args.kv_offload_policy, args.kv_events_endpoint, args.kv_events_replay_endpoint,
    )


def _tokenizer_path(args: EngineArgs, model_path: Path) -> Path | None:
    if args.skip_tokenizer:
        return None
    if args.tokenizer is None:
        return model_path
    path = Path(args.tokenizer).expanduser()
    if not path.is_dir():
        raise ValueError(f"tokenizer {args.tokenizer!r} is not a directory (tokenizers are never downloaded)")
    return path


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
