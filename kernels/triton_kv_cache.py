"""Triton kernels that move data into and between paged KV caches.

Layouts are those of ``kernels.reference``: a cache is ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (keys, then values) and contiguous, so slot ``s`` of half ``c``
starts at element ``c * half_numel + s * num_kv_heads * head_dim`` and block ``b`` at
``c * half_numel + b * block_numel``.
"""

import torch
import triton
import triton.language as tl

# Elements one copy_blocks program moves: big enough to amortise the block-id loads, small
# enough that a typical block (16 tokens x 8 heads x 128 dims) still spreads over 16 programs.
_COPY_CHUNK = 1024


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    half_numel,  # elements in the keys half of the cache
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = kv_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(dst, key, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(dst + half_numel, value, mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their slots.

    ``slot_mapping`` ``[num_tokens]`` (int64) holds ``block_id * block_size + offset``; ``-1``
    skips the token. ``key``/``value`` may be strided views (last dim contiguous) and must have
    the cache dtype: unlike the reference this does not convert (a conversion to bf16 would
    round differently under the interpreter than compiled).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.dtype == value.dtype == kv_cache.dtype, "K/V must have the cache dtype"
    assert kv_cache.is_contiguous() and key.stride(2) == 1 and value.stride(2) == 1
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache[0].numel(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_half_numel,
    dst_half_numel,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    half = tl.program_id(1)  # 0 = keys, 1 = values
    offsets = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < BLOCK_NUMEL
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    data = tl.load(src_ptr + half * src_half_numel + src_block * BLOCK_NUMEL + offsets, mask=mask)
    tl.store(dst_ptr + half * dst_half_numel + dst_block * BLOCK_NUMEL + offsets, data, mask=mask)


def copy_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """Copy block ``src_block_ids[i]`` of ``src_cache`` to ``dst_block_ids[i]`` of ``dst_cache``.

    Both caches are contiguous ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` of one
    dtype and per-block shape; their ``num_blocks`` may differ (a GPU cache and a staging
    buffer for the CPU tier). Both, and the integer id tensors, must be on the device the
    kernel runs on. Destination ids must be distinct.
    """
    assert src_cache.shape[2:] == dst_cache.shape[2:] and src_cache.dtype == dst_cache.dtype
    assert src_cache.is_contiguous() and dst_cache.is_contiguous()
    num_pairs = src_block_ids.numel()
    if num_pairs == 0:
        return
    block_numel = src_cache[0, 0].numel()
    _copy_blocks_kernel[(num_pairs, 2, triton.cdiv(block_numel, _COPY_CHUNK))](
        src_cache,
        dst_cache,
        src_block_ids,
        dst_block_ids,
        src_cache[0].numel(),
        dst_cache[0].numel(),
        BLOCK_NUMEL=block_numel,
        CHUNK=_COPY_CHUNK,
    )
