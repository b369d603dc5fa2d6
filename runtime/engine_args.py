"""The engine flags shared by ``generate``, ``serve`` and ``bench``, and what they resolve to.

Each flag is declared once, as an ``EngineArgs`` field made by ``flag``: its default, help,
choices and the rule its values meet. The argparse options, the checks on construction and
the fields the worker's config shares with it all derive from those fields.
"""

import argparse
import dataclasses
import json
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, get_args

from strata.connector.policies import EVICTION_POLICIES
from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from strata.engine_core.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from strata.runtime.executors.ray_config import RAY_PLACEMENT_STRATEGIES, RayConfig
from strata.worker.config import (
    ATTENTION_BACKENDS, CPU_BF16_LINEAR_MODES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, WorkerConfig,
)

DEFAULT_MAX_MODEL_LEN_CAP = 8192
EXECUTORS = ("uni", "mp", "ray")
DP_ROUTING_POLICIES = ("cache-aware", "least-loaded", "round-robin")
# A CPU step is compute-bound from a few rows on, so each draft costs nearly a token's compute:
# n-gram drafts on prose lost 4% at 4 requests and 14% at 8 (docs/performance.md).
CPU_SPECULATION_BATCH_LIMIT = 4
# A CPU decode walks each sequence's blocks from memory, and a sequence's blocks lie apart once
# it grows step by step beside others: 64 positions a block made workload A 6.6% faster than 16,
# B 10%, the long one 11% (Xeon-AMX, docs/performance.md). The Triton kernels keep 16.
CPU_BLOCK_SIZE = 64
CUDA_BLOCK_SIZE = 16

T = TypeVar("T")


@dataclass(frozen=True)
class Rule:
    """A condition on a flag's value; ``requirement`` says it after the field's name in the error."""

    holds: Callable[[Any], bool]
    requirement: str


def at_least(bound: int) -> Rule:
    return Rule(lambda value: value >= bound, f"must be >= {bound}")


POSITIVE = Rule(lambda value: value > 0, "must be > 0")
A_FRACTION = Rule(lambda value: 0 < value <= 1, "must be in (0, 1]")
A_ZMQ_ENDPOINT = Rule(lambda value: value.startswith(("tcp://", "ipc://")), "must be a tcp:// or ipc:// endpoint")


@dataclass(frozen=True)
class Flag:
    """How an ``EngineArgs`` field shows on the command line, and which values it takes."""

    help: str | None
    choices: tuple[str, ...] | None
    rule: Rule | None
    short: str | None  # a second option string, e.g. "-tp"

    def check(self, name: str, value: Any) -> None:
        """Raise ``ValueError`` naming the field if ``value`` is not one it takes."""
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.rule is not None and not self.rule.holds(value):
            raise ValueError(f"{name} {self.rule.requirement}, got {value!r}")


def flag(
    default: T,
    help: str | None = None,
    *,
    choices: tuple[str, ...] | None = None,
    rule: Rule | None = None,
    short: str | None = None,
) -> T:
    """An ``EngineArgs`` field, carrying its ``Flag``."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, choices, rule, short)})


@dataclass
class EngineArgs:
    """Everything a user can set about the engine. ``model=None`` is the default model."""

    model: str | None = flag(None, "HF directory, .gguf file, config.json or gemma3-270m (default: SmolLM2-135M-Instruct)")
    load_format: str = flag("auto", "dummy: seeded random weights of the config's shapes", choices=LOAD_FORMATS)
    tokenizer: str | None = flag(None, "tokenizer directory (default: the model's)")
    skip_tokenizer: bool = flag(False, "no tokenizer: token-id prompts only, no output text")
    dtype: str = flag("auto", choices=DTYPES)
    kv_cache_dtype: str = flag(
        "auto",
        "the KV cache's dtype; auto: the model's (the torch attention backend: float32). bfloat16 halves a "
        "float32 model's cache and the bytes its decode attention reads, at bfloat16's rounding of keys and "
        "values; fp8: float8 e4m3 with a scale of 1 (values saturate at +-448), a quarter of float32 (on "
        "CUDA: compute capability >= 8.9)",
        choices=KV_CACHE_DTYPES,
    )
    cpu_bf16_linear: str = flag(
        "auto",
        "a bfloat16 model on CPU: steps of few rows stream the bfloat16 weights (the crossover measured "
        "at start), larger ones run a GEMM: float32 on float32 copies (2x the memory) or bfloat16; auto: "
        "bfloat16 where the CPU has AVX512-BF16/AMX; native: the bfloat16 GEMM at every step",
        choices=CPU_BF16_LINEAR_MODES,
    )
    quantization: str = flag(
        "auto",
        "gguf: a GGUF model's linears keep the file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) "
        "and CPU kernels multiply them as stored; none: dequantize at load; auto: gguf where the model is a "
        "GGUF file run on the CPU and every block type has a kernel, FP8 where the checkpoint stores FP8 "
        "(compressed-tensors); fp8: FP8 e4m3 linears with per-channel scales (quantized at load, or as an FP8 "
        "checkpoint stores them), activations quantized per token (W8A8), on GPUs of compute capability >= 8.9; "
        "fp8-weight-only: the same weights, a GEMM that converts them in registers; int8: INT8 weight-only "
        "linears with per-channel scales, any GPU (CPU: dequantized per step)",
        choices=QUANTIZATIONS,
    )
    device: str = flag("auto", "cpu, cuda, cuda:K (mp ranks take cuda:K, cuda:K+1, ...) or auto")
    tensor_parallel_size: int = flag(1, short="-tp", rule=at_least(1))
    pipeline_parallel_size: int = flag(
        1, "pipeline stages, each a contiguous run of decoder layers on its own tensor-parallel ranks",
        short="-pp", rule=at_least(1),
    )
    pipeline_layer_partition: list[int] | None = flag(
        None, "decoder layers per pipeline stage, e.g. 7,9 (default: balanced by layer count)"
    )
    executor: str = flag("mp", "uni: one process (debugging)", choices=EXECUTORS)
    async_scheduling: bool = flag(
        True,
        "the mp and ray executors get the next step while they run one (the EngineCore schedules it "
        "meanwhile); not with --executor uni, speculative decoding or pipeline stages",
    )
    max_num_batched_tokens: int = flag(2048, "token budget per step")
    max_num_seqs: int = flag(256, "most requests in one step")
    max_model_len: int | None = flag(None, f"default: the model's, capped at {DEFAULT_MAX_MODEL_LEN_CAP}")
    block_size: int | None = flag(
        None, f"tokens per KV-cache block (default: {CPU_BLOCK_SIZE} on CPU, {CUDA_BLOCK_SIZE} on GPUs)",
        rule=at_least(1),
    )
    kv_cache_memory: int | None = flag(None, "KV-cache bytes per rank")
    num_gpu_blocks: int | None = flag(None, "KV-cache blocks (overrides --kv-cache-memory)")
    gpu_memory_utilization: float = flag(
        0.9, "CUDA: share of the GPU for weights, activations, graphs and KV cache", rule=A_FRACTION
    )
    enforce_eager: bool = flag(False, "CUDA: no CUDA graphs")
    cuda_graph_sizes: list[int] | None = flag(
        None, "CUDA: decode batch sizes to capture, e.g. 1,2,4,8 (default 1,2,4,8,16,...,max-num-seqs)"
    )
    enable_prefix_caching: bool = flag(True)
    scheduling_policy: str = flag("fcfs", choices=SCHEDULING_POLICIES)
    speculative_method: str | None = flag(
        None,
        "ngram: draft tokens by prompt lookup; draft: by a smaller model (--speculative-model); either is "
        "verified in one forward (off by default)",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = flag(3, "most drafts a request verifies per step", rule=at_least(1))
    ngram_min: int = flag(1, "ngram: shortest suffix matched", rule=at_least(1))
    ngram_max: int = flag(4, "ngram: longest suffix matched, tried first", rule=at_least(1))
    speculative_model: str | None = flag(
        None, "draft: the draft model (HF directory or .gguf file) with the model's vocabulary; the model itself "
        "with --speculative-draft-layers for a self-draft"
    )
    speculative_draft_layers: int | None = flag(
        None, "draft: run only the draft model's first N decoder layers (with its norm and head)", rule=at_least(1)
    )
    speculative_disable_by_batch_size: int | None = flag(
        None, "steps with more running requests than this verify no drafts (default: "
        f"{CPU_SPECULATION_BATCH_LIMIT} on CPU, where a step of many rows is compute-bound; no limit on GPUs)",
        rule=at_least(1),
    )
    attention_backend: str | None = flag(None, choices=ATTENTION_BACKENDS)
    worker_timeout_s: float = flag(60.0, "a worker silent this long is declared hung")
    kv_offload_cpu_bytes: int | None = flag(None, "CPU KV tier size, total over all ranks (off by default)")
    kv_offload_policy: str = flag("lru", "CPU tier eviction policy", choices=EVICTION_POLICIES)
    kv_offload_block_size: int | None = flag(None, "tokens per CPU block (a multiple of --block-size)")
    ray_address: str | None = flag(None, "ray: head host:port (default $RAY_ADDRESS, else a local cluster)")
    ray_placement_strategy: str = flag(
        "PACK", "ray: rank layout (STRICT_SPREAD: each rank on a node of its own)", choices=RAY_PLACEMENT_STRATEGIES
    )
    ray_placement_timeout_s: float = flag(60.0, "ray: fail if the ranks are not placed by then", rule=POSITIVE)
    kv_events_endpoint: str | None = flag(
        None, "publish KV events on this ZeroMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 (off by default)",
        rule=A_ZMQ_ENDPOINT,
    )
    kv_events_replay_endpoint: str | None = flag(
        None, "replay socket for missed KV-event batches (default: the next TCP port, or PATH-replay)",
        rule=A_ZMQ_ENDPOINT,
    )
    data_parallel_size: int = flag(1, "engine replicas, each with its own TP workers", short="-dp", rule=at_least(1))
    dp_routing: str = flag("cache-aware", "how requests pick a replica", choices=DP_ROUTING_POLICIES)
    dp_load_margin: int = flag(
        2048, "cache-aware: tokens of extra load a prefix hit may cost before least-loaded wins", rule=at_least(0)
    )
    dp_router_max_hashes: int = flag(1 << 20, "cache-aware: block hashes the router remembers", rule=at_least(1))
    enable_lora: bool = flag(
        False, "serve LoRA adapters (implied by --lora-modules and --enable-lora-runtime-updates)"
    )
    lora_modules: list[str] | None = flag(
        None, "LoRA adapters to serve from the start, as NAME=PATH (a PEFT directory); requests pick one "
        "by its NAME as their model"
    )
    max_loras: int = flag(1, "LoRA: adapters in one step (slots of the workers' adapter pool)", rule=at_least(1))
    max_lora_rank: int = flag(16, "LoRA: the largest adapter rank the slots hold", rule=at_least(1))
    max_cpu_loras: int | None = flag(
        None, "LoRA: adapters the workers keep in CPU memory to swap into a slot (default: --max-loras)",
        rule=at_least(1),
    )
    enable_lora_runtime_updates: bool = flag(
        False, "serve: let API clients load and unload adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)"
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None or field.default is not None:  # None where it is the default means unset
                field.metadata["flag"].check(field.name, value)
        if self.executor == "uni" and self.tensor_parallel_size != 1:
            raise ValueError("the uni executor runs one rank: use --executor mp for tensor parallelism")
        if self.executor == "uni" and self.pipeline_parallel_size != 1:
            raise ValueError(
                "the uni executor runs one rank: --pipeline-parallel-size needs --executor mp or ray"
            )
        partition = self.pipeline_layer_partition
        if partition is not None and (len(partition) != self.pipeline_parallel_size or min(partition) < 1):
            raise ValueError(
                f"pipeline_layer_partition {partition} must give each of the {self.pipeline_parallel_size} "
                "pipeline stages (--pipeline-parallel-size) at least one layer"
            )
        if self.executor == "uni" and self.data_parallel_size != 1:
            raise ValueError("the uni executor runs one replica: use --executor mp or ray for data parallelism")
        if self.executor == "ray" and self.data_parallel_size > 1 and not (self.ray_address or os.environ.get("RAY_ADDRESS")):
            raise ValueError(
                "data parallelism on Ray needs a running cluster that every replica joins: start one "
                "(strata launch ray --head) and pass --ray-address or set RAY_ADDRESS"
            )
        if self.skip_tokenizer and self.tokenizer is not None:
            raise ValueError("tokenizer and skip_tokenizer exclude each other")
        if self.cuda_graph_sizes is not None and not all(1 <= size <= self.max_num_seqs for size in self.cuda_graph_sizes):
            raise ValueError(
                f"cuda_graph_sizes must lie in 1..max_num_seqs ({self.max_num_seqs}), got {self.cuda_graph_sizes}"
            )
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): the CPU "
                "memory holds every adapter a step may use"
            )
        self.lora_module_paths()  # raises if a --lora-modules entry is not NAME=PATH
        self.speculative_config(self.device)  # raises if the speculative flags disagree
        if self.speculative_method == "draft" and self.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_method draft does not support --pipeline-parallel-size > 1 (the draft runs on the "
                "last stage, which would need every earlier stage's tokens first)"
            )

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves adapters: asked for, or implied by adapters to serve."""
        return self.enable_lora or bool(self.lora_modules) or self.enable_lora_runtime_updates

    def lora_module_paths(self) -> dict[str, str]:
        """``--lora-modules`` as adapter name -> path; ValueError on a malformed or repeated name."""
        paths: dict[str, str] = {}
        for entry in self.lora_modules or ():
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules entries are NAME=PATH, got {entry!r}")
            if name in paths:
                raise ValueError(f"lora_modules names {name!r} twice")
            paths[name] = path
        return paths

    def speculative_config(self, device: str) -> SpeculativeConfig:
        limit = self.speculative_disable_by_batch_size
        if limit is None and device == "cpu":
            limit = CPU_SPECULATION_BATCH_LIMIT
        return SpeculativeConfig(
            self.speculative_method, self.num_speculative_tokens, self.ngram_min, self.ngram_max,
            self.speculative_model, self.speculative_draft_layers, limit,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One option per field: ``--max-num-seqs`` sets ``max_num_seqs``."""
        for field in dataclasses.fields(EngineArgs):
            option: Flag = field.metadata["flag"]
            long_name = "--" + field.name.replace("_", "-")
            names = (long_name, option.short) if option.short else (long_name,)
            parser.add_argument(*names, default=field.default, help=option.help, **_parse_options(field))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in vars(args).items() if name in names})


def _parse_options(field: dataclasses.Field) -> dict[str, Any]:
    """How argparse reads a field's option, from its type: a bool is a switch (with a
    ``--no-`` form where it defaults to on), ``list[int]`` comma-separated integers, ``list[str]``
    one or more words."""
    value_type = field.type
    if isinstance(value_type, types.UnionType):  # int | None: parse an int
        (value_type,) = (member for member in get_args(value_type) if member is not type(None))
    if value_type is bool:
        return {"action": argparse.BooleanOptionalAction if field.default else "store_true"}
    if value_type == list[int]:
        return {"type": _int_list}
    if value_type == list[str]:
        return {"nargs": "+"}
    return {"type": value_type, "choices": field.metadata["flag"].choices}


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
    from strata.worker.model_loader import gguf_file, resolve_model_path
    from strata.worker.model_registry import model_class

    path = resolve_model_path(args.model)
    device = _device(args.device)
    block_size = args.block_size or (CPU_BLOCK_SIZE if device == "cpu" else CUDA_BLOCK_SIZE)
    model_config = json.loads((path / "config.json").read_text())
    # Fail before any process starts.
    model_cls = model_class(model_config.get("model_type", ""), model_config.get("architectures"))
    if args.pipeline_parallel_size > 1:
        _check_pipeline_split(args, model_cls, model_config)
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
        block_size=block_size,
        policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        speculative=args.speculative_config(device),
        pipeline_depth=args.pipeline_parallel_size,
        max_loras=args.max_loras if args.lora_enabled else 0,
        async_scheduling=(
            args.async_scheduling
            and args.executor != "uni"
            and args.pipeline_parallel_size == 1
            and args.speculative_method is None
        ),
    )
    engine_fields = dataclasses.asdict(args)
    same_named = {name: engine_fields[name] for name in WorkerConfig.__struct_fields__ if name in engine_fields}
    gguf = gguf_file(args.model)
    resolved_here = {
        "model": str(path), "device": device, "max_model_len": max_model_len, "block_size": block_size,
        "gguf_file": None if gguf is None else str(gguf), "enable_lora": args.lora_enabled,
    } | _resolve_draft(args, model_config)
    worker = WorkerConfig(**(same_named | resolved_here))
    ray_config = None
    if args.executor == "ray":
        ray_config = RayConfig(args.ray_address, args.ray_placement_strategy, args.ray_placement_timeout_s)
    return ResolvedConfig(
        path, _tokenizer_path(args, path), scheduler, worker, args.executor, args.worker_timeout_s, ray_config,
        args.kv_offload_policy, args.kv_events_endpoint, args.kv_events_replay_endpoint,
    )


def _resolve_draft(args: EngineArgs, model_config: dict[str, Any]) -> dict[str, Any]:
    """The workers' draft-model settings: the draft located (a GGUF converted once, like the
    model) and refused unless its vocabulary is the model's and it has the layers asked for."""
    from strata.worker.model_loader import gguf_file, resolve_model_path

    if args.speculative_method != "draft":
        return {"speculative_model": None, "speculative_draft_layers": None}
    path = resolve_model_path(args.speculative_model)
    draft_config = json.loads((path / "config.json").read_text())
    if draft_config.get("vocab_size") != model_config.get("vocab_size"):
        raise ValueError(
            f"the draft model {args.speculative_model} has a vocabulary of {draft_config.get('vocab_size')} tokens, "
            f"the model {model_config.get('vocab_size')}: a draft must share the model's tokenizer"
        )
    layers = int(draft_config["num_hidden_layers"])
    if args.speculative_draft_layers is not None and args.speculative_draft_layers > layers:
        raise ValueError(f"speculative_draft_layers {args.speculative_draft_layers} exceeds the draft model's {layers} layers")
    gguf = gguf_file(args.speculative_model)
    return {"speculative_model": str(path), "speculative_gguf_file": None if gguf is None else str(gguf)}


def _check_pipeline_split(args: EngineArgs, model_cls: type, model_config: dict[str, Any]) -> None:
    """Refuse a model family that cannot be split into stages, or a split its layers cannot fill."""
    if not model_cls.supports_pipeline_parallel:
        raise ValueError(
            f"{model_cls.__name__} does not support --pipeline-parallel-size > 1 (its decoder runs as one stage)"
        )
    from strata.worker.pipeline_parallel import split_layers

    split_layers(int(model_config["num_hidden_layers"]), args.pipeline_parallel_size, args.pipeline_layer_partition)


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
