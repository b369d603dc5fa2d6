"""The Triton paged attention equals ``kernels.reference.paged_attention``.

Runs compiled on CUDA when present, else under the Triton interpreter (see tests/conftest.py);
shapes are tiny because the interpreter is slow.

Tolerances (``atol = rtol``, outputs are of magnitude ~1): fp32 ``1e-4``, only summation order
and exp2-vs-exp differ; fp16 ``5e-3`` and bf16 ``2e-2``, a few ulps of the output dtype: both
outputs are rounded to it (the interpreter truncates fp32 -> bf16 instead of rounding to
nearest) and the kernel also rounds the softmax weights to it for the P @ V product.
"""

import itertools
from dataclasses import dataclass

import pytest
import torch

from kernels import reference, triton_attention
from worker.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    TritonAttentionBackend,
    get_attention_backend,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
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

    def reference(self) -> torch.Tensor:
        return reference.paged_attention(
            self.query,
            self.kv_cache,
            self.meta.block_tables,
            self.meta.query_start_loc,
            self.meta.seq_lens,
            self.scale,
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


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("split_kv", [False, True], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("dtype", TOLERANCES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("group,head_dim,block_size", LAYOUTS)
@pytest.mark.parametrize("batch", BATCHES)
def test_matches_reference(batch, group, head_dim, block_size, dtype, split_kv):
    b = make_batch(*BATCHES[batch], group, head_dim, block_size, dtype)
    out = triton_attention.paged_attention(
        b.query,
        b.kv_cache,
        b.meta.block_tables,
        b.meta.query_start_loc,
        b.meta.seq_lens,
        b.scale,
        split_kv=split_kv,
    )
    assert out.dtype == dtype
    assert_close(out, b.reference())


@pytest.mark.parametrize(
    "max_seq_len,num_programs,forced,expected",
    [
        (4096, 8, False, 16),  # few programs, long context: split up to _MIN_PARTITION
        (100_000, 8, False, 32),  # capped by _TARGET_PROGRAMS
        (4096, 512, False, 1),  # the GPU is already full
        (200, 8, False, 1),  # too short to be worth it
        (200, 8, True, 7),  # forced: partitions down to one TILE_N
        (20, 8, True, 2),  # forced: at least two, even if one stays empty
    ],
)
def test_split_heuristic(max_seq_len, num_programs, forced, expected):
    assert triton_attention._num_splits(max_seq_len, num_programs, forced=forced) == expected


def test_triton_backend_matches_torch_backend():
    """Whole forward: strided q/k/v views of one projection, K/V written, then attention."""
    group, head_dim = 3, 80
    b = make_batch(*BATCHES["mixed"], group, head_dim, 16, torch.float32)
    num_tokens, num_heads = b.query.shape[0], NUM_KV_HEADS * group
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, device=DEVICE)
    query, key, value = qkv.split([num_heads * head_dim, *[NUM_KV_HEADS * head_dim] * 2], dim=1)
    query = query.view(num_tokens, num_heads, head_dim)
    key, value = (t.view(num_tokens, NUM_KV_HEADS, head_dim) for t in (key, value))

    caches = b.kv_cache, b.kv_cache.clone()
    outs = [
        backend.forward(query, key, value, cache, b.meta, b.scale)
        for backend, cache in zip((TritonAttentionBackend(), TorchAttentionBackend()), caches)
    ]
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)
    assert_close(outs[0], outs[1])


def test_get_attention_backend():
    assert get_attention_backend(None, torch.device("cpu")).name == "torch"
    assert get_attention_backend(None, torch.device("cuda")).name == "triton"
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"
    assert get_attention_backend("torch", torch.device("cuda")).name == "torch"
    with pytest.raises(ValueError, match="'torch', 'triton'"):
        get_attention_backend("flash", torch.device("cpu"))
