"""Paged attention for a whole mixed batch (chunked prefills and decodes) in one Triton launch.

Semantics and layouts are those of ``kernels.reference.paged_attention``: sequence ``i`` owns
query rows ``query_start_loc[i]:query_start_loc[i + 1]``, its new tokens, which are the last of
its ``seq_lens[i]`` context tokens; their K/V are already in the paged cache
``[2, num_blocks, block_size, num_kv_heads, head_dim]``, reached through ``block_tables[i]``.

Work decomposition: a program takes a tile of ``BLOCK_Q`` consecutive new tokens of one
sequence together with the ``GROUP`` query heads that share one KV head (GQA), i.e.
``BLOCK_Q * GROUP_PAD`` rows of a ``tl.dot``, so each K/V tile is loaded once per group. It
walks the context in tiles of ``TILE_N`` keys (gathered per key through the block table, so
tiles need not align with cache blocks), from its first query's window start (0 without a
sliding window) to its last query's position (causality), with an online softmax in fp32.

The grid never depends on per-sequence lengths, so launching needs no device-to-host sync:
sequence ``i`` is given the tile slots from ``query_start_loc[i] // BLOCK_Q + i`` on, which
always leaves room for its ``ceil(q_len / BLOCK_Q)`` tiles; a program finds its sequence by
binary search and exits if its slot is surplus. That is ``num_tokens // BLOCK_Q + num_seqs``
slots in all.

Split-KV (flash decoding): when there are too few programs to fill the GPU and contexts are
long, the context is cut into partitions that run as separate programs, each writing an
unnormalised partial output with its running max and sum; a second kernel rescales and adds
them up. See ``_num_splits`` for the heuristic.
"""

import torch
import triton
import triton.language as tl

# Keys per inner iteration. tl.dot needs every dimension >= 16 when compiled.
TILE_N = 32
# Rows (query tokens x heads of a group) per program: few for decodes, which have one token
# per sequence, more for prefill chunks, where rows reuse each K/V tile.
_DECODE_ROWS = 16
_PREFILL_ROWS = 64
# Split-KV heuristic. An H100 has 132 SMs: below about two programs per SM it is underused.
_TARGET_PROGRAMS = 256
# Automatic splitting never makes partitions shorter than this: below it the extra partial
# writes and the combine kernel cost more than the parallelism gains.
_MIN_PARTITION = 256
# log2(e): the kernels use exp2, which maps to one hardware instruction.
_LOG2E = 1.4426950408889634
# The window of full attention: longer than any context (positions are int32).
_NO_WINDOW = 2**30
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile_slot, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile slot is <= ``tile_slot`` (binary search)."""
    lo = tl.zeros((), tl.int32)
    hi = tl.zeros((), tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        owns = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile_slot
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] in the query dtype; with SPLIT, [splits, T, H, D] fp32 partials
    max_ptr,  # SPLIT only: [splits, T, H] fp32 running max (log2 domain)
    sum_ptr,  # SPLIT only: [splits, T, H] fp32 running sum of exponentials
    query_ptr,
    kv_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window in positions; a value past every context = full attention
    num_tokens,
    num_seqs,
    partition_len,  # SPLIT only: context tokens per partition, a multiple of TILE_N
    stride_qt,
    stride_qh,
    stride_table,
    stride_kv,
    stride_block,
    stride_slot,
    stride_kvh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_slot, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_token = (tile_slot - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - q_len

    # Row r is new token first_token + r // GROUP_PAD, query head r % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = first_token + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        query_ptr
        + (q_start + token)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    position = context_before + token

    # Causality: nothing after the tile's last query token is ever visible to it; nothing
    # before its first query token's window either.
    kv_end = tl.minimum(seq_len, context_before + first_token + BLOCK_Q)
    kv_start = tl.maximum(context_before + first_token - window + 1, 0)
    if SPLIT:
        partition_start = tl.program_id(2) * partition_len
        kv_start = tl.maximum(kv_start, partition_start)
        kv_end = tl.minimum(kv_end, partition_start + partition_len)

    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined for rows that have
    # seen no visible key yet (possible when a split partition lies after a row's position).
    m = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table
    for tile_start in range(kv_start, kv_end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        key_offset = block * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_kvh
        k = tl.load(  # [HEAD_PAD, TILE_N], i.e. already transposed for q @ k
            kv_cache_ptr + key_offset[None, :] + dims[:, None],
            mask=dim_ok[:, None] & pos_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        v = tl.load(
            kv_cache_ptr + stride_kv + key_offset[:, None] + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = pos_ok[None, :] & (pos[None, :] <= position[:, None]) & (pos[None, :] > position[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new

    row = (q_start + token) * NUM_HEADS + head  # flat (token, head) index of the outputs
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        partial = tl.program_id(2) * num_tokens * NUM_HEADS + row
        tl.store(out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
        tl.store(max_ptr + partial, m, mask=row_ok)
        tl.store(sum_ptr + partial, l, mask=row_ok)
    else:
        # Rows past the tile's last token may see no key at all (l = 0); they are not stored.
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(
            out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, H, D]
    partial_ptr,  # [splits, T, H, D] fp32
    max_ptr,  # [splits, T, H] fp32
    sum_ptr,  # [splits, T, H] fp32
    num_rows,  # T * H
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    partial_row = splits * num_rows + row
    m = tl.load(max_ptr + partial_row, mask=split_ok, other=float("-inf"))
    # Partitions that saw no visible key (max -1e30, sum 0) get weight 0.
    weight = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(weight * tl.load(sum_ptr + partial_row, mask=split_ok, other=0.0), 0)
    partial = tl.load(
        partial_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * partial, 0) / total
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    split_kv: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (GQA aware),
    within the last ``sliding_window`` positions if given.

    ``query`` ``[num_tokens, num_heads, head_dim]`` (last dim contiguous), ``kv_cache``
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, of the query's dtype or
    another one the kernel converts to the query's as it loads (float8 e4m3, a float32 query's
    bfloat16), ``block_tables`` int32 ``[num_seqs, max_blocks]``, ``query_start_loc`` int32
    ``[num_seqs + 1]``, ``seq_lens`` int32 ``[num_seqs]`` (context including the new tokens).
    Returns ``[num_tokens, num_heads, head_dim]`` in the query dtype.

    Optional host-side hints: ``max_query_len`` picks a smaller tile for decode-only batches
    (without it, a batch with one token per sequence is taken to be decode-only);
    ``max_seq_len`` sizes split-KV partitions (without it the split decision reads
    ``seq_lens`` back from the device). ``split_kv`` forces split-KV on or off; ``None``
    leaves it to the heuristic of ``_num_splits``.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert kv_cache.is_contiguous() and query.stride(2) == 1
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    decode_only = max_query_len == 1 if max_query_len is not None else num_tokens == num_seqs
    block_q = max(1, (_DECODE_ROWS if decode_only else _PREFILL_ROWS) // group_pad)
    tile_slots = num_tokens // block_q + num_seqs

    num_splits = 1
    if split_kv is not False:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # a device sync
        num_splits = _num_splits(max_seq_len, tile_slots * num_kv_heads, forced=bool(split_kv))
    split = num_splits > 1
    if split:
        partition_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), TILE_N) * TILE_N
        rows = (num_splits, num_tokens, num_heads)
        partial = query.new_empty((*rows, head_dim), dtype=torch.float32)
        maxes = query.new_empty(rows, dtype=torch.float32)
        sums = torch.empty_like(maxes)
    else:
        partition_len, partial, maxes, sums = 0, out, None, None

    head_pad = triton.next_power_of_2(head_dim)
    dots_in = dot_dtype(query.dtype)
    _paged_attention_kernel[(tile_slots, num_kv_heads, num_splits)](
        partial,
        maxes,
        sums,
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2E,
        sliding_window or _NO_WINDOW,
        num_tokens,
        num_seqs,
        partition_len,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        SPLIT=split,
        DOT_DTYPE=dots_in,
        # fp32 inputs: three TF32 passes on tensor cores, about as accurate as fp32 FMAs
        # ("ieee") and without their register spills. Ignored for 16-bit inputs.
        DOT_PRECISION="tf32x3",
    )
    if split:
        _combine_splits_kernel[(num_tokens * num_heads,)](
            out,
            partial,
            maxes,
            sums,
            num_tokens * num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out


def _num_splits(max_seq_len: int, num_programs: int, *, forced: bool) -> int:
    """How many partitions to cut each context into (1 = no split-KV).

    Split only as far as needed to reach ``_TARGET_PROGRAMS`` programs, and never into
    partitions shorter than ``_MIN_PARTITION`` tokens, so many sequences or short contexts
    stay unsplit. Forcing it (tests) allows partitions down to one ``TILE_N`` and at least two.
    """
    min_partition = TILE_N if forced else _MIN_PARTITION
    most_useful = triton.cdiv(_TARGET_PROGRAMS, num_programs)
    return max(2 if forced else 1, min(triton.cdiv(max_seq_len, min_partition), most_useful))


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype ``tl.dot`` multiplies in: the input's (tensor cores), except under the
    interpreter, which has no bf16 arithmetic (triton#11584) and gets fp32 instead."""
    if dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        return tl.float32
    return _TL_DTYPES[dtype]
