"""The bfloat16 chunk attention (``kernels.cpu_attention.chunk_attention``, ``vdpbf16ps``) equals
float64 attention on the same bfloat16 values within what its roundings allow.

The scores are exact bfloat16 products summed in float32; the probabilities are rounded to
bfloat16 (relative error at most 2^-9 each, so the weighted sum of values moves by at most
2^-9 of the largest value magnitude), and the output is rounded to bfloat16 once (2^-9 of its
magnitude). The bound below doubles both.
"""

import pytest
import torch

from strata.kernels import cpu_attention

pytestmark = pytest.mark.skipif(
    not cpu_attention.chunk_kernel_available(), reason="the chunk kernel needs a CPU with AVX512-BF16"
)

BLOCK_SIZE = 16


def paged_chunk(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """A bfloat16 cache holding one sequence's ``context`` positions in shuffled blocks, and
    ``rows`` new tokens' queries as a strided view of a wider projection."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-context // BLOCK_SIZE)
    cache = torch.randn(2, num_blocks + 5, BLOCK_SIZE, kv_heads, head_dim, generator=generator).bfloat16()
    blocks = torch.randperm(num_blocks + 5, generator=generator)[:num_blocks].int()
    projection = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=generator).bfloat16()
    return cache, blocks, projection[:, :heads]


def expected_attention(cache, blocks, query, context, scale, sliding_window=None) -> torch.Tensor:
    """float64 attention of the query rows (the last of ``context`` positions) over the cache."""
    rows, heads, _ = query.shape
    keys, values = (cache[i][blocks.long()].flatten(0, 1)[:context].double() for i in (0, 1))
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    key_position = torch.arange(context)[None, :]
    query_position = torch.arange(context - rows, context)[:, None]
    seen = key_position <= query_position
    if sliding_window is not None:
        seen &= key_position > query_position - sliding_window
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def assert_within_roundings(out: torch.Tensor, expected: torch.Tensor, values: torch.Tensor) -> None:
    bound = 2**-8 * expected.abs() + 2**-8 * values.abs().max().double() + 1e-6
    excess = (out.double() - expected).abs() - bound
    assert (excess <= 0).all(), f"largest excess over the bound: {excess.max().item():.3g}"


@pytest.mark.parametrize(
    "rows, context, heads, kv_heads, head_dim, sliding_window",
    [
        (130, 130, 9, 3, 64, None),  # a whole prompt, not a multiple of the 64-position tile
        (100, 300, 9, 3, 64, None),  # a chunk after cached context
        (77, 500, 9, 3, 64, 40),  # a sliding window shorter than the chunk
        (70, 200, 8, 1, 128, None),  # head_dim 128, eight query heads on one KV head
        (65, 65, 4, 4, 64, None),  # no grouping; a last item of fewer query vectors
    ],
    ids=["whole-prompt", "after-context", "window", "head-dim-128", "no-groups"],
)
def test_chunk_attention_equals_float64_attention_within_its_roundings(
    rows, context, heads, kv_heads, head_dim, sliding_window
):
    cache, blocks, query = paged_chunk(rows, context, heads, kv_heads, head_dim)
    out = torch.empty(rows, heads, head_dim, dtype=torch.bfloat16)
    assert cpu_attention.chunk_attention(query, cache, blocks, context, 0.125, out, sliding_window)
    assert_within_roundings(out, expected_attention(cache, blocks, query, context, 0.125, sliding_window), cache[1])


def test_positions_outside_the_context_are_never_read():
    cache, blocks, query = paged_chunk(64, 100, 6, 2, 64)
    expected = expected_attention(cache, blocks, query, 100, 0.125)
    tail = cache[:, blocks[-1].long()].clone()
    tail[100 % BLOCK_SIZE :] = float("nan")  # the last block's slots past the context
    cache[:, blocks[-1].long()] = tail
    out = torch.empty(64, 6, 64, dtype=torch.bfloat16)
    assert cpu_attention.chunk_attention(query, cache, blocks, 100, 0.125, out)
    assert_within_roundings(out, expected, cache[1][blocks.long()].flatten(0, 1)[:100])


@pytest.mark.parametrize("what", ["float32-query", "head-dim-96"])
def test_chunks_the_kernel_does_not_take_are_left_untouched(what):
    head_dim = 96 if what == "head-dim-96" else 64
    cache, blocks, query = paged_chunk(64, 64, 4, 2, head_dim)
    if what == "float32-query":
        query = query.float()
    out = torch.zeros(64, 4, head_dim, dtype=torch.bfloat16)
    assert not cpu_attention.chunk_attention(query, cache, blocks, 64, 0.125, out)
    assert out.eq(0).all()
