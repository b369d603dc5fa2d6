"""Ragged paged-attention batches for the kernel tests: random queries and a randomly laid out
paged cache that already holds every sequence's context."""

import itertools
from dataclasses import dataclass

import torch

from strata.kernels import cpu_kv_cache, reference
from strata.worker.attention import AttentionMetadata, TorchAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_KV_HEADS = 2

# (new tokens per sequence, total context per sequence); lengths straddle block boundaries.
BATCHES = {
    "decode": ([1, 1, 1], [1, 17, 40]),
    "prefill": ([7, 20], [7, 20]),
    "chunk_with_context": ([5, 16], [37, 50]),
    "mixed": ([1, 9, 1, 4], [33, 9, 64, 21]),
}
# (query heads per KV head, head_dim, block_size): every GQA ratio, head size and block size.
LAYOUTS = [(1, 64, 16), (3, 80, 32), (8, 96, 16), (8, 128, 32)]


@dataclass
class Batch:
    """A ragged batch whose context K/V already sit in a randomly laid out paged cache."""

    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    meta: AttentionMetadata
    scale: float

    def reference(self, sliding_window: int | None = None) -> torch.Tensor:
        return reference.paged_attention(
            self.query,
            self.kv_cache,
            self.meta.block_tables,
            self.meta.query_start_loc,
            self.meta.seq_lens,
            self.scale,
            sliding_window=sliding_window,
        )


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    spare_blocks: int = 3,
) -> Batch:
    """Random queries and cache; each sequence gets distinct, shuffled blocks (spare ones hold
    garbage that a wrong gather would pick up). Slot mapping points at the new tokens' slots."""
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slot_mapping = []
    used = 0
    for i, (q_len, seq_len, n) in enumerate(zip(q_lens, seq_lens, blocks_per_seq)):
        block_tables[i, :n] = order[used : used + n]
        used += n
        for pos in range(seq_len - q_len, seq_len):
            block = int(block_tables[i, pos // block_size])
            slot_mapping.append(block * block_size + pos % block_size)
    shape = (2, num_blocks, block_size, NUM_KV_HEADS, head_dim)
    kv_cache = torch.randn(shape, generator=generator).to(dtype)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=generator).to(dtype)
    int32 = {"dtype": torch.int32, "device": DEVICE}
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], **int32),
        seq_lens=torch.tensor(seq_lens, **int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return Batch(query.to(DEVICE), kv_cache.to(DEVICE), meta, head_dim**-0.5)


def forward_beside_torch_backend(
    backend, b: Batch, sliding_window: int | None = None, *, keys_tiled: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Run ``backend`` and the torch backend on ``b`` as the model calls them (strided q/k/v
    views of one projection, K/V written first), each on its own copy of the cache (with
    ``keys_tiled``, ``backend``'s in the C kernels' layout, ``kernels.cpu_kv_cache``). Returns
    (the two caches, both in the reference's layout, and the two outputs), ``backend``'s first."""
    num_tokens, num_heads, head_dim = b.query.shape
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim).to(b.query.dtype).to(DEVICE)
    query, key, value = qkv.split([num_heads * head_dim, *[NUM_KV_HEADS * head_dim] * 2], dim=1)
    query = query.view(num_tokens, num_heads, head_dim)
    key, value = (t.view(num_tokens, NUM_KV_HEADS, head_dim) for t in (key, value))
    caches = cpu_kv_cache.tile_keys(b.kv_cache) if keys_tiled else b.kv_cache, b.kv_cache.clone()
    outs = tuple(
        each.forward(query, key, value, cache, b.meta, b.scale, sliding_window)
        for each, cache in zip((backend, TorchAttentionBackend()), caches)
    )
    if keys_tiled:
        caches = cpu_kv_cache.untile_keys(caches[0]), caches[1]
    return caches, outs
