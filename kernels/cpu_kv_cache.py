"""KV-cache writes and block copies on the CPU with the C code of ``csrc/kv_cache.c`` (same
semantics as ``kernels.reference.write_kv_cache`` and ``copy_blocks``), and the C kernels' key
layout.

A cache of the C kernels is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` like the
reference's, its values laid out so, but its keys tiled (``csrc/kv_layout.h``): per run of
``KEY_TILE`` slots and per KV head, ``[head_dim / 2][KEY_TILE slots][2 dims]``, so that one load
is a pair of dims at 16 positions and attention scores a tile without reductions across lanes.
``tile_keys`` and ``untile_keys`` convert whole caches between the two layouts."""

import torch

from strata.kernels import native

KEY_TILE = 16  # csrc/kv_layout.h


def _tiles(keys: torch.Tensor) -> torch.Tensor:
    """The contiguous key storage ``keys`` (``[num_blocks, block_size, kv_heads, head_dim]``)
    viewed as its tiles, ``[num_blocks, block_size / KEY_TILE, kv_heads, head_dim / 2, KEY_TILE, 2]``."""
    num_blocks, block_size, num_kv_heads, head_dim = keys.shape
    return keys.view(num_blocks, block_size // KEY_TILE, num_kv_heads, head_dim // 2, KEY_TILE, 2)


def tile_keys(kv_cache: torch.Tensor) -> torch.Tensor:
    """A copy of the reference-layout cache ``kv_cache`` with its keys as the C kernels keep them."""
    tiled = kv_cache.clone(memory_format=torch.contiguous_format)
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    rows = kv_cache[0].reshape(num_blocks, block_size // KEY_TILE, KEY_TILE, num_kv_heads, head_dim // 2, 2)
    _tiles(tiled[0]).copy_(rows.permute(0, 1, 3, 4, 2, 5))
    return tiled


def untile_keys(kv_cache: torch.Tensor) -> torch.Tensor:
    """A copy of the C kernels' cache ``kv_cache`` (contiguous) with its keys in the reference's layout."""
    rows = kv_cache.clone()
    rows[0].copy_(_tiles(kv_cache[0]).permute(0, 1, 4, 2, 3, 5).reshape(kv_cache.shape[1:]))
    return rows


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``kernels.reference.write_kv_cache`` in C, the keys tiled as the C kernels keep them: store
    new keys/values ``[num_tokens, num_kv_heads, head_dim]`` (each token's heads contiguous,
    tokens may be strided) at their slots; slot ``-1`` skips a token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or value.dtype != key.dtype or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError("key, value and the cache disagree on shape or dtype")
    if kv_cache.shape[2] % KEY_TILE or head_dim % 2:
        raise ValueError(f"the C cache needs blocks of a multiple of {KEY_TILE} slots and an even head_dim")
    for name, tensor in {"key": key, "value": value}.items():
        if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
            raise ValueError(f"{name} must have each token's heads contiguous")
    if not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("the cache must be contiguous and slot_mapping contiguous int64")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {num_tokens} tokens")
    status = native.load_library().write_kv_cache(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        native.DTYPE_CODES[key.dtype],
        kv_cache.data_ptr(),
        kv_cache.shape[1] * kv_cache.shape[2],
        native.CACHE_DTYPE_CODES[kv_cache.dtype],
        num_kv_heads,
        head_dim,
        slot_mapping.data_ptr(),
        num_tokens,
        torch.get_num_threads(),
    )
    if status != 0:
        raise IndexError(f"slot_mapping points outside the cache's {kv_cache.shape[1] * kv_cache.shape[2]} slots")


def copy_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
    """``kernels.reference.copy_blocks`` in C, on one thread: block ``src_block_ids[i]`` of
    ``src_cache`` to block ``dst_block_ids[i]`` of ``dst_cache`` (both CPU caches of one dtype
    and block shape, any block counts). Unlike torch's copies it starts no OpenMP threads, so
    the offload copier thread does not slow the model's own parallel regions down."""
    if src_cache.dtype != dst_cache.dtype or src_cache.shape[2:] != dst_cache.shape[2:] or src_cache.shape[0] != 2:
        raise ValueError("the caches disagree on dtype or block shape")
    if not (src_cache.is_contiguous() and dst_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    src_ids, dst_ids = (ids.to(torch.int64).contiguous() for ids in (src_block_ids, dst_block_ids))
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError("src_block_ids and dst_block_ids must be 1-D and of one length")
    status = native.load_library().copy_blocks(
        src_cache.data_ptr(),
        src_cache.shape[1],
        dst_cache.data_ptr(),
        dst_cache.shape[1],
        src_cache[0, 0].numel() * src_cache.element_size(),
        src_ids.data_ptr(),
        dst_ids.data_ptr(),
        src_ids.numel(),
    )
    if status != 0:
        raise IndexError("a block id is outside its cache")
