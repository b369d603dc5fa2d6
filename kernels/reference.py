"""Torch reference kernels: the oracle the Triton and C kernels are tested against, and the CPU
path where the C kernels cannot build.

Layouts shared by every backend:
- ``kv_cache``: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
  (index 0 holds keys, 1 holds values).
- ``slot_mapping[t] = block_id * block_size + offset`` for new token ``t``; ``-1`` skips it.
- A batch is ragged: sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
  (its new tokens) and has ``seq_lens[i]`` tokens of context in total, the new ones last.
  Its context lives in the blocks ``block_tables[i, :ceil(seq_lens[i] / block_size)]``.
- Attention is causal; with a sliding window ``w`` (HF's convention, as in Mistral and Gemma 3)
  the query at position ``i`` sees the keys at positions ``j`` with ``i - w < j <= i``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def float8_as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a float8 one's bytes as uint8: torch's index copies have no float8 kernels."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their slots (rounded to
    the cache's dtype; a float8 one saturates at its largest finite value)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = float8_as_bytes(kv_cache).view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slots, float8_as_bytes(key[keep].to(kv_cache.dtype)))
    flat[1].index_copy_(0, slots, float8_as_bytes(value[keep].to(kv_cache.dtype)))


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
    blocks = float8_as_bytes(src_cache).index_select(1, src_block_ids.to(src_cache.device, torch.long))
    float8_as_bytes(dst_cache).index_copy_(1, dst_block_ids.to(dst_cache.device, torch.long), blocks.to(dst_cache.device))


# Decodes run in buckets of similar context length: each bucket is gathered padded to its own
# longest context, so the padding (memory traffic, the CPU path's cost) stays under this ratio.
_BUCKET_SPREAD = 1.5
# Rows of a masked chunk's slices (plan_chunks): on EPYC-Zen4 a 2048-token chunk under a mask ran
# at 118 GFLOPS in 256-row slices, 70 whole.
MASKED_CHUNK_ROWS = 256
_MIN_BUCKET = 8


@dataclass
class DecodeBucket:
    rows: torch.Tensor  # [D] query rows of single-token sequences
    blocks: torch.Tensor  # [D, max_blocks] block ids, padded with block 0
    mask: torch.Tensor  # [D, 1, 1, max_blocks * block_size] True = real context


@dataclass
class Chunk:
    """One sequence's new tokens when there are several: its query rows, the blocks of its
    context, the context length and the mask (None = plain causal attention of a whole prompt)."""

    rows: slice
    blocks: torch.Tensor
    context: int
    mask: torch.Tensor | None


@dataclass
class AttentionPlan:
    """The index work of one step, shared by every layer with the same window: decode buckets,
    and the multi-token chunks."""

    decodes: list[DecodeBucket]
    chunks: list[Chunk]


def plan_attention(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> AttentionPlan:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = sorted((i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1), key=lambda i: lens[i])
    buckets: list[list[int]] = []
    for i in decodes:
        if not buckets or (lens[i] > _BUCKET_SPREAD * lens[buckets[-1][0]] and len(buckets[-1]) >= _MIN_BUCKET):
            buckets.append([])
        buckets[-1].append(i)
    return AttentionPlan(
        [_decode_bucket(b, starts, lens, block_tables, block_size, sliding_window) for b in buckets],
        plan_chunks(block_tables, query_start_loc, seq_lens, block_size, sliding_window),
    )


def plan_chunks(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    min_tokens: int = 2,
    slice_masked: bool = True,
) -> list[Chunk]:
    """The chunks of the sequences with at least ``min_tokens`` new tokens. With
    ``slice_masked``, a chunk that needs a mask (it follows earlier context, or has a window) is
    cut into slices of at most ``MASKED_CHUNK_ROWS`` rows, each over only the positions its last
    row sees: torch's fused attention skips what a plain causal mask hides but computes every
    score an explicit mask hides, so a chunk of 1,900 tokens after 1,100 cached ones would
    compute a third more."""
    starts = query_start_loc.tolist()
    chunks = []
    for i, context in enumerate(seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        if q_len < min_tokens:
            continue
        if not slice_masked or _plain_causal(q_len, context, sliding_window):
            slices = [(0, q_len)]
        else:
            slices = [(first, min(first + MASKED_CHUNK_ROWS, q_len)) for first in range(0, q_len, MASKED_CHUNK_ROWS)]
        for first, end in slices:
            seen = context - q_len + end  # the positions the slice's last row sees
            blocks = block_tables[i, : -(-seen // block_size)]  # int32 ids, as the C kernel takes them
            mask = _chunk_mask(end - first, seen, sliding_window, block_tables.device)
            chunks.append(Chunk(slice(starts[i] + first, starts[i] + end), blocks, seen, mask))
    return chunks


def _plain_causal(q_len: int, context: int, sliding_window: int | None) -> bool:
    """Whether ``q_len`` new tokens over ``context`` positions are a whole prompt, unwindowed."""
    return sliding_window is None and q_len == context


def _chunk_mask(q_len: int, context: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of the ``context`` positions each of the ``q_len`` new tokens sees; None when that
    is plain causal attention of a whole prompt."""
    # New token j sits at position context - q_len + j and sees every position up to it.
    if _plain_causal(q_len, context, sliding_window):
        return None
    mask = torch.ones(q_len, context, dtype=torch.bool, device=device).tril(context - q_len)
    if sliding_window is not None:
        mask = mask.triu(context - q_len - sliding_window + 1)
    return mask


def _decode_bucket(
    seqs: list[int],
    starts: list[int],
    lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> DecodeBucket:
    device = block_tables.device
    context = torch.tensor([lens[i] for i in seqs], device=device)
    max_blocks = -(-max(lens[i] for i in seqs) // block_size)
    positions = torch.arange(max_blocks * block_size, device=device)[None, :]
    mask = positions < context[:, None]
    if sliding_window is not None:
        mask &= positions >= context[:, None] - sliding_window
    return DecodeBucket(
        rows=torch.tensor([starts[i] for i in seqs], device=device),
        blocks=block_tables[torch.tensor(seqs, device=device), :max_blocks].long(),
        mask=mask[:, None, None, :],
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (GQA aware), in
    float32, within ``sliding_window`` positions if given. ``query`` is ``[num_tokens, num_heads,
    head_dim]``; the new tokens' K/V must already be in the cache. Single-token sequences
    (decodes) run in a few padded batches of similar length; multi-token chunks run one attention
    call each, so the cost is per sequence, never per token. Pass the step's ``plan`` (built with
    the same window) to skip rebuilding it for every layer."""
    if plan is None:
        plan = plan_attention(block_tables, query_start_loc, seq_lens, kv_cache.shape[2], sliding_window)
    out = torch.empty_like(query)
    for bucket in plan.decodes:
        _decode_attention(query, kv_cache, bucket, scale, out)
    for chunk in plan.chunks:
        chunk_attention(query, kv_cache, chunk, scale, out)
    return out


def chunk_attention(query: torch.Tensor, kv_cache: torch.Tensor, chunk: Chunk, scale: float, out: torch.Tensor) -> None:
    """Attention of one chunk's query rows over its context, in float32, into the same rows of ``out``."""
    keys, values = _gather(kv_cache, chunk.blocks)
    # With a batch dimension torch takes its fused (flash) CPU attention; 3-D inputs fall back to
    # the unfused path, which materialises every score and ran 3x slower on a 4000-token context.
    attn = F.scaled_dot_product_attention(
        query[chunk.rows].transpose(0, 1)[None].float(),
        keys[: chunk.context].transpose(0, 1)[None].float(),
        values[: chunk.context].transpose(0, 1)[None].float(),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    out[chunk.rows] = attn[0].transpose(0, 1).to(out.dtype)


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``blocks`` (any leading shape), flattened to token order."""
    gathered = kv_cache[:, blocks]
    shape = (*blocks.shape[:-1], blocks.shape[-1] * kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4])
    return gathered[0].reshape(shape), gathered[1].reshape(shape)


def _decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, scale: float, out: torch.Tensor
) -> None:
    """A bucket of single-token sequences at once, padded to its longest context."""
    keys, values = _gather(kv_cache, bucket.blocks)  # [D, context, kv heads, dim]
    attn = F.scaled_dot_product_attention(
        query[bucket.rows].unsqueeze(2).float(),  # [D, heads, 1, dim]
        keys.transpose(1, 2).float(),
        values.transpose(1, 2).float(),
        attn_mask=bucket.mask,
        scale=scale,
        enable_gqa=True,
    )
    out[bucket.rows] = attn.squeeze(2).to(out.dtype)


# Largest magnitude each 8-bit weight format stores: a row's largest weight is scaled to it.
SCALED_FORMAT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}
# Floor on a scale's absolute maximum: an all-zero row or token then gets a tiny finite scale
# (its values quantize to zero) instead of a division by zero.
_MIN_AMAX = 1e-12


def channel_scales(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 scales that map each channel's absolute maximum ``amax`` to ``dtype``'s largest value."""
    return amax.float().clamp(min=_MIN_AMAX) / SCALED_FORMAT_MAX[dtype]


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight [N, K] / scale [N]`` rounded to the nearest ``dtype`` value (int8 or float8_e4m3fn)."""
    limit = SCALED_FORMAT_MAX[dtype]
    scaled = (weight.float() / scale[:, None]).clamp(-limit, limit)
    return scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)


def quantize_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``q * scale[:, None] ~ weight``: one float32 scale per output row."""
    scale = channel_scales(weight.abs().amax(dim=1), dtype)
    return quantize_rows(weight, scale, dtype), scale


def scaled_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x (weight * scale[:, None])^T + bias`` in float32, rounded to ``x``'s dtype: the dequantized
    computation a weight-only 8-bit linear stands for."""
    y = F.linear(x.float(), weight.float()) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_activations_fp8(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [M, K], scale [M, 1])``: each row scaled by its own absolute maximum (dynamic, per
    token), or by ``input_scale`` (static: one float32 scale for every token, from a checkpoint)."""
    if input_scale is None:
        scale = channel_scales(x.abs().amax(dim=1, keepdim=True), torch.float8_e4m3fn)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return quantize_rows(x, scale[:, 0], torch.float8_e4m3fn), scale


def w8a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dequantized computation of an FP8 W8A8 linear: ``x`` quantized to FP8 as
    ``quantize_activations_fp8`` does, both sides dequantized, multiplied in float32."""
    x_fp8, x_scale = quantize_activations_fp8(x, input_scale)
    return scaled_linear(x_fp8.float() * x_scale, weight, scale, bias).to(x.dtype)


def lora_delta(
    x: torch.Tensor,
    token_slots: torch.Tensor,
    adapters: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]],
    scales: dict[int, float],
    part_rows: list[int],
) -> torch.Tensor:
    """The LoRA delta of a linear with parts of ``part_rows`` output rows, token by slot:
    ``x[t] A^T B^T * scale`` of the adapter in slot ``token_slots[t]`` (none for -1), per part;
    ``adapters[slot][p]`` is part ``p``'s ``(A [r, in], B [rows, r])`` or None (not targeted).
    Loops over slots and parts: the oracle of ``kernels/lora.py``."""
    delta = torch.zeros(x.shape[0], sum(part_rows), dtype=torch.float32)
    offsets = [sum(part_rows[:p]) for p in range(len(part_rows))]
    for slot, parts in adapters.items():
        tokens = token_slots == slot
        for offset, rows, pair in zip(offsets, part_rows, parts):
            if pair is not None:
                a, b = pair
                delta[tokens, offset : offset + rows] = x[tokens].float() @ a.float().T @ b.float().T * scales[slot]
    return delta
