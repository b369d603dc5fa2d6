"""CUDA graphs for decode-only steps: the model's forward captured once per padded batch size.

A decode step of ``B`` requests runs as the graph of the smallest captured size ``S >= B``;
rows ``B..S`` are padding that writes nothing to the KV cache and whose outputs are dropped.
A captured graph replays fixed kernels on fixed addresses, so every input it reads lives in
persistent buffers (``DecodeInputBuffers``) that each step overwrites in place, and the
attention kernel is captured with host-side hints that hold for any step: one query token per
row and a context of at most ``max_model_len`` tokens.

``PaddedDecode`` is the device-independent part (size ladder, padding, buffers, the padded
forward) and runs on the CPU in tests; ``CudaGraphRunner`` adds capture and replay.
"""

import bisect
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from strata.worker.attention import AttentionMetadata
from strata.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def graph_batch_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> list[int]:
    """The padded batch sizes to capture, ascending.

    ``requested`` (``--cuda-graph-sizes``) is used as given (each must be in
    ``1..max_num_seqs``); by default 1, 2, 4 and then every multiple of 8 up to
    ``max_num_seqs``, which is always included so that every decode step has a graph.
    """
    if requested:
        bad = [size for size in requested if not 1 <= size <= max_num_seqs]
        if bad:
            raise ValueError(f"cuda_graph_sizes must lie in 1..max_num_seqs ({max_num_seqs}), got {bad}")
        return sorted(set(requested))
    sizes = {size for size in _SMALL_SIZES if size <= max_num_seqs}
    sizes.update(range(_SIZE_STEP, max_num_seqs + 1, _SIZE_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_batch_size(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``batch`` rows; None when none does."""
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else None


def is_decode_only(num_scheduled: np.ndarray) -> bool:
    return bool((num_scheduled == 1).all())


class DecodeInputBuffers:
    """The persistent device tensors a captured decode reads, for up to ``max_batch`` rows.

    Padding rows get token 0 at position 0, slot -1 (no KV write) and a context of one token
    read through block-table entries that always hold some valid block id.
    """

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_batch = max_batch
        int32 = {"dtype": torch.int32, "device": device}
        self.token_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, **int32)
        self.query_start_loc = torch.arange(max_batch + 1, **int32)  # one token per row, always
        self.seq_lens = torch.ones(max_batch, **int32)

    def load(self, inputs: StepInputs, size: int) -> None:
        """Copy a decode step of ``B <= size`` rows in and pad rows ``B..size``."""
        batch = len(inputs.rows)
        pad = size - batch
        self.token_ids[:size].copy_(_padded(inputs.token_ids, pad, 0), non_blocking=True)
        self.positions[:size].copy_(_padded(inputs.positions, pad, 0), non_blocking=True)
        self.slot_mapping[:size].copy_(_padded(inputs.slot_mapping, pad, -1), non_blocking=True)
        self.seq_lens[:size].copy_(_padded(inputs.seq_lens.astype(np.int32), pad, 1), non_blocking=True)
        width = inputs.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(torch.from_numpy(np.ascontiguousarray(inputs.block_tables)), non_blocking=True)

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )


def _padded(values: np.ndarray, pad: int, fill: int) -> torch.Tensor:
    return torch.from_numpy(np.concatenate((values, np.full(pad, fill, dtype=values.dtype))))


class PaddedDecode:
    """Runs decode-only steps at a padded batch size through persistent input buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        sizes: Sequence[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = list(sizes)
        self.max_model_len = max_model_len
        self.buffers = DecodeInputBuffers(self.sizes[-1], -(-max_model_len // block_size), device)

    def size_for(self, num_scheduled: np.ndarray) -> int | None:
        """The padded size to run this step at, or None to run it eagerly (not decode-only, or
        more rows than the largest size)."""
        if not is_decode_only(num_scheduled):
            return None
        return padded_batch_size(self.sizes, len(num_scheduled))

    def forward(self, size: int) -> torch.Tensor:
        """The model over the buffers' first ``size`` rows: hidden states ``[size, hidden]``."""
        buffers = self.buffers
        meta = buffers.metadata(size, self.max_model_len)
        return self.model(buffers.token_ids[:size], buffers.positions[:size], self.kv_caches, meta)

    def run(self, inputs: StepInputs, size: int) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a decode step of ``B`` rows run at ``size``."""
        self.buffers.load(inputs, size)
        return self.forward(size)[: len(inputs.rows)]


class CudaGraphRunner(PaddedDecode):
    """``PaddedDecode`` with one CUDA graph per size, captured by ``capture`` and replayed by ``run``.

    All graphs share one memory pool, captured largest first so the smaller ones reuse its blocks.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.forward(size)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %s) in %.1f s, %.0f MiB",
            len(self.graphs),
            _describe(self.sizes),
            time.perf_counter() - started,
            (free_before - free_after) / (1 << 20),
        )

    def run(self, inputs: StepInputs, size: int) -> torch.Tensor:
        self.buffers.load(inputs, size)
        self.graphs[size].replay()
        return self.outputs[size][: len(inputs.rows)]


def _describe(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]}"
