"""Torch reference kernels: the CPU path and the oracle the Triton kernels are tested against.

Layouts shared by every backend:
- ``kv_cache``: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
  (index 0 holds keys, 1 holds values).
- ``slot_mapping[t] = block_id * block_size + offset`` for new token ``t``; ``-1`` skips it.
- A batch is ragged: sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
  (its new tokens) and has ``seq_lens[i]`` tokens of context in total, the new ones last.
  Its context lives in the blocks ``block_tables[i, :ceil(seq_lens[i] / block_size)]``.
"""

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slots, key[keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value[keep].to(kv_cache.dtype))


def copy_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """Copy block ``src_block_ids[i]`` of ``src_cache`` to block ``dst_block_ids[i]`` of ``dst_cache``.

    Both caches have the per-block layout ``[2, *, block_size, num_kv_heads, head_dim]``;
    their ``num_blocks`` (and devices) may differ. Destination ids must be distinct.
    """
    blocks = src_cache.index_select(1, src_block_ids.to(src_cache.device, torch.long))
    dst_cache.index_copy_(1, dst_block_ids.to(dst_cache.device, torch.long), blocks.to(dst_cache.device))


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[num_tokens, num_kv_heads, head_dim]`` of one sequence's context."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_tokens // block_size)
    blocks = kv_cache[:, block_table[:num_blocks].long()]
    blocks = blocks.reshape(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    return blocks[0, :num_tokens], blocks[1, :num_tokens]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (GQA aware).

    ``query`` is ``[num_tokens, num_heads, head_dim]``; the new tokens' K/V must already be in
    the cache. Single-token sequences (decodes) run as one padded batch; multi-token chunks run
    one attention call each, so the cost is per sequence, never per token.
    """
    out = torch.empty_like(query)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    starts = query_start_loc[:-1].tolist()
    lens = seq_lens.tolist()
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        _decode_attention(query, kv_cache, block_tables, starts, lens, decodes, scale, out)
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            rows = slice(starts[i], starts[i] + q_len)
            key, value = gather_context(kv_cache, block_tables[i], lens[i])
            out[rows] = _chunk_attention(query[rows], key, value, scale)
    return out


def _chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention for a chunk of new tokens that sit at the end of the context."""
    q_len, ctx_len = query.shape[0], key.shape[0]
    # New token j sits at position ctx_len - q_len + j and sees every position up to it.
    mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=query.device).tril(ctx_len - q_len)
    attn = F.scaled_dot_product_attention(
        query.transpose(0, 1).float(),
        key.transpose(0, 1).float(),
        value.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return attn.transpose(0, 1).to(query.dtype)


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: list[int],
    lens: list[int],
    decodes: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """All single-token sequences at once: gather their blocks padded to the longest one."""
    block_size = kv_cache.shape[2]
    index = torch.tensor(decodes, device=query.device)
    rows = torch.tensor([starts[i] for i in decodes], device=query.device)
    ctx = torch.tensor([lens[i] for i in decodes], device=query.device)
    max_blocks = -(-max(lens[i] for i in decodes) // block_size)
    tables = block_tables[index, :max_blocks].long()
    num_seqs, num_kv_heads, head_dim = len(decodes), kv_cache.shape[3], kv_cache.shape[4]
    kv = kv_cache[:, tables].reshape(2, num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    positions = torch.arange(max_blocks * block_size, device=query.device)
    mask = (positions[None, :] < ctx[:, None])[:, None, None, :]
    attn = F.scaled_dot_product_attention(
        query[rows].unsqueeze(2).float(),  # [seqs, heads, 1, dim]
        kv[0].transpose(1, 2).float(),
        kv[1].transpose(1, 2).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    out[rows] = attn.squeeze(2).to(out.dtype)
