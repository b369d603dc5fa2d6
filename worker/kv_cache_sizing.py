"""How many blocks one rank's KV cache, and its share of the CPU offload tier, hold (``KVCacheSizer``).

The cache holds ``num_gpu_blocks``, else ``kv_cache_memory`` bytes, else on the CPU a default and
on CUDA what a profile run leaves: dummy steps of the largest sizes measure the memory
everything but the cache needs there (``DeviceMemory``), and the cache gets what those leave of
``gpu_memory_utilization`` of the device (``kv_cache_bytes``, a pure function of the measured
numbers so that it is tested without a GPU).
"""

import logging
from dataclasses import dataclass

import numpy as np
import torch

from strata.worker.attention import AttentionMetadata
from strata.worker.config import WorkerConfig
from strata.worker.input_batch import to_device
from strata.worker.llama import LlamaForCausalLM
from strata.worker.parallel_state import TensorParallel
from strata.worker.sampler import RandomSampling, SamplingMetadata, sample

logger = logging.getLogger(__name__)

GIB = 1 << 30
CPU_DEFAULT_KV_CACHE_BYTES = GIB


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


class KVCacheSizer:
    """Sizes one rank's KV cache and its share of the CPU tier, in blocks of ``block_size``
    tokens whose keys and values ``model`` holds in ``cache_dtype`` on ``device``. With a
    speculative ``draft`` model, whose own cache has a block for every block of the target's
    (same ids), a block of the budget pays for both: the two caches split it in proportion to
    their layers' K/V sizes. The CPU tier keeps the target's blocks only."""

    def __init__(
        self,
        config: WorkerConfig,
        tp: TensorParallel,
        model: LlamaForCausalLM,
        cache_dtype: torch.dtype,
        device: torch.device,
        draft: LlamaForCausalLM | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.model = model
        self.draft = draft
        self.cache_dtype = cache_dtype
        self.block_size = config.block_size
        self.device = device

    def bytes_per_block(self) -> int:
        """A block's keys and values over all layers, the draft's included."""
        draft = 0 if self.draft is None else self.model_bytes_per_block(self.draft)
        return self.model_bytes_per_block(self.model) + draft

    def model_bytes_per_block(self, model: LlamaForCausalLM) -> int:
        """A block's keys and values over ``model``'s layers."""
        element = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * self.block_size * model.num_kv_heads_per_rank * model.head_dim * element * model.num_layers

    def num_blocks(self, graph_sizes: list[int]) -> int:
        """Blocks in the KV cache, as ``WorkerConfig`` says; on CUDA the profile run counts the
        graphs of ``graph_sizes`` that will be captured."""
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                memory = self._profile_device_memory(graph_sizes)
                budget = kv_cache_bytes(memory, self.config.gpu_memory_utilization)
                logger.info(
                    "rank %d: KV cache %.2f GiB = %.2f x %.2f GiB total - weights %.2f - peak activations %.2f "
                    "- CUDA graphs %.2f - outside torch %.2f",
                    self.tp.rank, budget / GIB, self.config.gpu_memory_utilization, memory.total / GIB,
                    memory.weights / GIB, memory.peak_activations / GIB, memory.cuda_graphs / GIB, memory.non_torch / GIB,
                )
            else:
                budget = CPU_DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(f"KV-cache memory of {budget} bytes holds no block of {self.bytes_per_block()} bytes")
        return num_blocks

    def num_offload_blocks(self) -> int:
        """Offload blocks in this rank's share of the CPU tier (the engine uses the smallest)."""
        total = self.config.kv_offload_cpu_bytes
        if not total:
            return 0
        offload_block_size = self.config.kv_offload_block_size or self.block_size
        if offload_block_size % self.block_size:
            raise ValueError(
                f"kv_offload_block_size ({offload_block_size}) must be a multiple of block_size ({self.block_size})"
            )
        per_block = self.model_bytes_per_block(self.model) * (offload_block_size // self.block_size)
        num_ranks = self.tp.size * self.config.pipeline_parallel_size
        num_blocks = total // num_ranks // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_offload_cpu_bytes={total} holds no offload block of {per_block} bytes per rank")
        return num_blocks

    def _profile_device_memory(self, graph_sizes: list[int]) -> DeviceMemory:
        """Measure the GPU memory everything but the KV cache needs: the weights, the largest
        step's activations (``max_num_batched_tokens`` tokens, sampler at ``max_num_seqs``
        rows) and, for the graph pool, those of a decode at the largest captured size."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(self.device)
        num_tokens = self.config.max_num_batched_tokens
        peak = self._peak_step_bytes(num_tokens, min(self.config.max_num_seqs, num_tokens))
        graphs = self._peak_step_bytes(graph_sizes[-1], graph_sizes[-1]) if graph_sizes else 0
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        return DeviceMemory(total, weights, peak, graphs, max(0, non_torch))

    @torch.inference_mode()
    def _peak_step_bytes(self, num_tokens: int, num_seqs: int) -> int:
        """The most a dummy step of ``num_tokens`` tokens over ``num_seqs`` sequences allocates,
        sampler (top-k and top-p on) included. Its scratch KV cache is not counted."""
        lengths = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        lengths[: num_tokens % num_seqs] += 1
        blocks_per_seq = -(-int(lengths.max()) // self.block_size)
        shape = (2, num_seqs * blocks_per_seq, self.block_size, self.model.num_kv_heads_per_rank, self.model.head_dim)
        caches = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in range(self.model.num_layers)]
        block_tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        ends = np.cumsum(lengths)
        positions = np.arange(num_tokens) - np.repeat(ends - lengths, lengths)
        seq_of_token = np.repeat(np.arange(num_seqs), lengths)
        slots = block_tables[seq_of_token, positions // self.block_size].astype(np.int64) * self.block_size
        meta = AttentionMetadata(
            slot_mapping=to_device(slots + positions % self.block_size, self.device),
            block_tables=to_device(block_tables, self.device),
            query_start_loc=to_device(np.concatenate(([0], ends)).astype(np.int32), self.device),
            seq_lens=to_device(lengths.astype(np.int32), self.device),
            max_query_len=int(lengths.max()),
            max_seq_len=int(lengths.max()),
        )
        rows = np.ones(num_seqs, dtype=np.float32)
        random = RandomSampling(
            temperature=to_device(rows, self.device),
            top_k=to_device(np.full(num_seqs, max(1, self.model.vocab_size // 2), dtype=np.int64), self.device),
            top_p=to_device(rows * 0.9, self.device),
            min_p=to_device(rows * 0, self.device),
            seeds=to_device(np.zeros(num_seqs, dtype=np.int64), self.device),
            output_positions=to_device(np.zeros(num_seqs, dtype=np.int64), self.device),
            need_top_k=True,
            need_top_p=True,
            need_min_p=False,
        )
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        stage_input = self.model.stage_input_buffer(num_tokens)
        if stage_input is not None:
            stage_input.zero_()
        hidden = self.model(token_ids, to_device(positions, self.device), caches, meta, stage_input)
        if self.model.stage.is_last:
            sample(self.model.compute_logits(hidden[to_device(ends - 1, self.device)]), SamplingMetadata(random=random))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

