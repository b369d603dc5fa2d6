"""Paged attention on the CPU with the C kernel of ``csrc/paged_attention.c`` (the semantics of
``kernels.reference.paged_attention``, over a cache whose keys are tiled as ``kernels.cpu_kv_cache``
writes them)."""

import torch

from strata.kernels import native


def is_available() -> bool:
    """Whether the C kernels built on this machine (see ``kernels.native``)."""
    return native.load_library() is not None


# What csrc/paged_attention.c handles: 16-float lanes, at most 16 chunks of them per head and
# 16 query heads per KV head.
LANES, MAX_HEAD_DIM, MAX_GROUP = 16, 256, 16


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel handles this attention shape (else use the torch reference)."""
    return (
        head_dim % LANES == 0
        and head_dim <= MAX_HEAD_DIM
        and block_size % LANES == 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


_CHUNK_BODIES = {2: "AMX tiles", 1: "AVX512-BF16 dot products"}


def chunk_body(dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """How ``chunk_attention`` computes a long chunk of ``dtype`` queries over a ``cache_dtype``
    cache (head sizes 64 and 128; float32 arithmetic for other sizes), for the start-up log."""
    library = native.load_library()
    if library is None:
        return "torch (no C kernels)"
    body = library.chunk_attention_bf16_body() if dtype == cache_dtype == torch.bfloat16 else 0
    return _CHUNK_BODIES.get(body, "float32 arithmetic")


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    long_chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Causal attention ``[num_tokens, num_heads, head_dim]`` (query's dtype) of each sequence's
    new tokens over its paged context, within the last ``sliding_window`` positions if given; the
    new tokens' K/V must already be in the cache. ``query`` may be a strided view as long as its
    last dimension is contiguous. Sequences with at least ``long_chunk_tokens`` new tokens are
    skipped: their rows of the result are uninitialised, for the caller to fill."""
    library = native.load_library()
    if library is None:
        raise RuntimeError("the C kernels are not available on this machine (see kernels.native)")
    _check(query, kv_cache, block_tables, query_start_loc, seq_lens)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if long_chunk_tokens is not None and long_chunk_tokens < 1:
        raise ValueError(f"long_chunk_tokens must be >= 1, got {long_chunk_tokens}")
    out = torch.empty(query.shape, dtype=query.dtype)
    status = library.paged_attention(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        native.DTYPE_CODES[query.dtype],
        kv_cache.data_ptr(),
        native.CACHE_DTYPE_CODES[kv_cache.dtype],
        kv_cache.shape[1],
        kv_cache.shape[2],
        kv_cache.shape[3],
        kv_cache.shape[4],
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        seq_lens.numel(),
        query.shape[1],
        sliding_window or 0,
        long_chunk_tokens or 0,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged_attention kernel could not allocate its work list")
    return out


def _check(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    # The kernel trusts its pointers: every layout assumption is checked here.
    for name, tensor in {"kv_cache": kv_cache, "query_start_loc": query_start_loc, "seq_lens": seq_lens}.items():
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    for name, tensor in {"block_tables": block_tables, "query_start_loc": query_start_loc, "seq_lens": seq_lens}.items():
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
    if block_tables.stride(1) != 1 or query.stride(2) != 1:
        raise ValueError("block_tables rows and query heads must be contiguous")
    if query.dtype not in native.DTYPE_CODES or kv_cache.dtype not in native.CACHE_DTYPE_CODES:
        raise ValueError(f"unsupported dtypes: query {query.dtype}, cache {kv_cache.dtype}")
    num_heads, (_, _, block_size, num_kv_heads, head_dim) = query.shape[1], kv_cache.shape
    if not supports(num_heads, num_kv_heads, head_dim, block_size):
        raise ValueError(
            f"attention shape not supported: {num_heads} query heads over {num_kv_heads} KV heads, "
            f"head_dim {head_dim}, block_size {block_size} (see cpu_attention.supports)"
        )


def chunk_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    blocks: torch.Tensor,
    context: int,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
) -> bool:
    """Attention of one chunk's new tokens ``query`` ``[rows, heads, head_dim]`` (heads
    contiguous; the last ``rows`` positions of a context of ``context``) over the paged
    ``kv_cache`` through ``blocks`` (int32, the chunk's block table row), causal, within the last
    ``sliding_window`` positions if given, into ``out`` (contiguous, query's shape and dtype).

    In bfloat16 on a CPU with AVX512-BF16 it multiplies with ``vdpbf16ps``
    (``csrc/chunk_attention_avx512bf16.c``); otherwise in float32 (``csrc/chunk_attention.c``),
    whatever the dtypes. Returns False, having written nothing, where no kernel takes the chunk
    (the C kernels are not built, a shape ``supports`` refuses, or a work buffer could not be
    allocated): the caller then runs torch's."""
    library = native.load_library()
    rows, num_heads = query.shape[:2]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if (
        library is None
        or not supports(num_heads, num_kv_heads, head_dim, block_size)
        or query.dtype not in native.DTYPE_CODES
        or kv_cache.dtype not in native.CACHE_DTYPE_CODES
        or out.dtype != query.dtype
        or query.stride(2) != 1
        or not (out.is_contiguous() and kv_cache.is_contiguous() and blocks.is_contiguous())
        or blocks.dtype != torch.int32
        or blocks.numel() * block_size < context
    ):
        return False
    common = (
        num_blocks, block_size, num_kv_heads, head_dim, blocks.data_ptr(), rows, context, num_heads,
        sliding_window or 0, scale, out.data_ptr(), torch.get_num_threads(),
    )
    if query.dtype == kv_cache.dtype == torch.bfloat16 and library.chunk_attention_bf16_body():
        status = library.chunk_attention_bf16(query.data_ptr(), query.stride(0), query.stride(1), kv_cache.data_ptr(), *common)
        if status == 0:
            return True
    status = library.chunk_attention(
        query.data_ptr(), query.stride(0), query.stride(1), native.DTYPE_CODES[query.dtype], kv_cache.data_ptr(),
        native.CACHE_DTYPE_CODES[kv_cache.dtype], *common,
    )
    return status == 0
