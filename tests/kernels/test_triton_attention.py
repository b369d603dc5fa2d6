"""The Triton paged attention equals ``kernels.reference.paged_attention``.

Runs compiled on CUDA when present, else under the Triton interpreter (see tests/conftest.py);
shapes are tiny because the interpreter is slow.

Tolerances (``atol = rtol``, outputs are of magnitude ~1): fp32 ``1e-4``, only summation order
and exp2-vs-exp differ; fp16 ``5e-3`` and bf16 ``2e-2``, a few ulps of the output dtype: both
outputs are rounded to it (the interpreter truncates fp32 -> bf16 instead of rounding to
nearest) and the kernel also rounds the softmax weights to it for the P @ V product.
"""

import pytest
import torch

from strata.kernels import reference, triton_attention
from paged_batches import BATCHES, LAYOUTS, forward_beside_torch_backend, make_batch
from strata.worker.attention import TritonAttentionBackend, get_attention_backend

TOLERANCES = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}

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


@pytest.mark.gpu
@pytest.mark.parametrize("split_kv", [False, True], ids=["single_pass", "split_kv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_long_context_gqa_decode_matches_reference_compiled(dtype, split_kv):
    """Decode rows over contexts of up to 4,096 tokens, 4 query heads per KV head, compiled on the
    GPU: the lengths the interpreter is too slow for, where splitting the KV range matters."""
    b = make_batch([1, 1, 1, 1], [4096, 4000, 2049, 4096], group=4, head_dim=128, block_size=16, dtype=dtype)
    out = triton_attention.paged_attention(
        b.query, b.kv_cache, b.meta.block_tables, b.meta.query_start_loc, b.meta.seq_lens, b.scale, split_kv=split_kv
    )
    assert_close(out, b.reference())


@pytest.mark.parametrize(
    "batch,sliding_window,dtype,split_kv",
    [
        ("mixed", 5, torch.float32, False),
        ("mixed", 1, torch.bfloat16, True),
        ("chunk_with_context", 20, torch.float32, True),
        ("chunk_with_context", 5, torch.bfloat16, False),
        ("mixed", 1000, torch.float32, False),
    ],
)
def test_sliding_window_matches_reference(batch, sliding_window, dtype, split_kv):
    group, head_dim, block_size = LAYOUTS[1]
    b = make_batch(*BATCHES[batch], group, head_dim, block_size, dtype)
    out = triton_attention.paged_attention(
        b.query,
        b.kv_cache,
        b.meta.block_tables,
        b.meta.query_start_loc,
        b.meta.seq_lens,
        b.scale,
        sliding_window=sliding_window,
        split_kv=split_kv,
    )
    assert_close(out, b.reference(sliding_window))


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


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_triton_backend_matches_torch_backend(sliding_window):
    """Whole forward: strided q/k/v views of one projection, K/V written, then attention."""
    group, head_dim = 3, 80
    b = make_batch(*BATCHES["mixed"], group, head_dim, 16, torch.float32)
    caches, outs = forward_beside_torch_backend(TritonAttentionBackend(), b, sliding_window)
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)
    assert_close(outs[0], outs[1])


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)],
    ids=["fp32-over-bf16", "fp32-over-fp8", "bf16-over-fp8"],
)
def test_triton_backend_over_a_narrower_cache_matches_torch_backend(dtype, cache_dtype):
    """``--kv-cache-dtype``: keys and values rounded by torch as they are written, then widened
    to the query's dtype as the kernel loads them."""
    b = make_batch(*BATCHES["mixed"], 3, 64, 16, dtype)
    b.kv_cache = b.kv_cache.to(cache_dtype)
    caches, outs = forward_beside_torch_backend(TritonAttentionBackend(), b)
    assert reference.float8_as_bytes(caches[0]).equal(reference.float8_as_bytes(caches[1]))
    assert_close(outs[0], outs[1])


def test_get_attention_backend():
    assert get_attention_backend(None, torch.device("cuda")).name == "triton"
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"
    assert get_attention_backend("torch", torch.device("cuda")).name == "torch"
    with pytest.raises(ValueError, match="'cpu', 'torch', 'triton'"):
        get_attention_backend("flash", torch.device("cpu"))
