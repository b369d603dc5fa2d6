"""The torch reference paged attention equals naive dense attention (ragged, GQA, both block
sizes, with and without a sliding window)."""

import pytest
import torch

from strata.kernels import reference


def dense_attention(query, key, value, scale, sliding_window=None):
    """Plain causal attention of ``query`` (the last tokens) over the whole context; with a
    window ``w``, the query at position i sees keys j with i - w < j <= i (HF's sliding mask)."""
    q_len, ctx = query.shape[0], key.shape[0]
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    key_pos, query_pos = torch.arange(ctx)[None, :], torch.arange(ctx - q_len, ctx)[:, None]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), value)


@pytest.mark.parametrize("slice_rows", [256, 3], ids=["whole-chunks", "chunks-in-slices"])
@pytest.mark.parametrize("sliding_window", [None, 1, 6, 20], ids=["full", "window1", "window6", "window20"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_reference_equals_dense_attention_on_a_ragged_batch(
    block_size, num_heads, num_kv_heads, sliding_window, slice_rows, monkeypatch
):
    monkeypatch.setattr(reference, "MASKED_CHUNK_ROWS", slice_rows)
    torch.manual_seed(block_size + num_heads)
    head_dim, num_blocks = 16, 64
    context = [1, 7, 33, 50, 17, 64]  # ragged, some not multiples of the block size
    new = [1, 7, 5, 1, 17, 1]  # decodes, a whole-prompt prefill, chunks with earlier context
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    tables = torch.randperm(num_blocks)[: len(context) * 4].view(len(context), 4).int()
    keys = [torch.randn(n, num_kv_heads, head_dim) for n in context]
    values = [torch.randn(n, num_kv_heads, head_dim) for n in context]
    for i, n in enumerate(context):
        positions = torch.arange(n)
        slots = tables[i, positions // block_size].long() * block_size + positions % block_size
        reference.write_kv_cache(keys[i], values[i], cache, slots)
    query = torch.randn(sum(new), num_heads, head_dim)
    starts = torch.tensor([0] + new).cumsum(0).int()
    out = reference.paged_attention(
        query, cache, tables, starts, torch.tensor(context).int(), 0.3, sliding_window=sliding_window
    )
    for i in range(len(context)):
        rows = slice(starts[i], starts[i + 1])
        expected = dense_attention(query[rows], keys[i], values[i], 0.3, sliding_window)
        assert torch.allclose(out[rows], expected, atol=1e-5)


def test_a_chunk_after_cached_context_is_cut_into_slices_over_what_each_last_row_sees():
    tables = torch.arange(64, dtype=torch.int32).view(1, 64)
    starts, context = torch.tensor([0, 600], dtype=torch.int32), torch.tensor([1000], dtype=torch.int32)
    chunks = reference.plan_chunks(tables, starts, context, block_size=16)
    assert [(c.rows.start, c.rows.stop, c.context, len(c.blocks)) for c in chunks] == [
        (0, 256, 656, 41), (256, 512, 912, 57), (512, 600, 1000, 63)
    ]
    assert chunks[0].mask.shape == (256, 656) and chunks[0].mask[0].sum() == 401  # row 0 sits at position 400


def test_a_whole_prompt_stays_one_causal_chunk():
    tables = torch.arange(64, dtype=torch.int32).view(1, 64)
    starts, context = torch.tensor([0, 600], dtype=torch.int32), torch.tensor([600], dtype=torch.int32)
    [chunk] = reference.plan_chunks(tables, starts, context, block_size=16)
    assert (chunk.rows, chunk.context, chunk.mask) == (slice(0, 600), 600, None)


def test_write_skips_slot_minus_one():
    cache = torch.zeros(2, 2, 4, 1, 2)
    key = torch.ones(2, 1, 2)
    reference.write_kv_cache(key, key, cache, torch.tensor([3, -1]))
    assert cache.view(2, -1, 1, 2)[0, 3].eq(1).all() and cache.sum() == 4
