"""The attention backends: the interface the model calls (``AttentionBackend``) over a paged KV
cache + block tables + slot mapping (``AttentionMetadata``), and its torch, C and Triton
implementations.

The model calls ``backend.forward`` once per layer; the backend writes the new K/V into
that layer's cache and attends, causally and, for a sliding-window layer, only over the last
``sliding_window`` positions (see ``kernels.reference``). Backends differ only in which kernels
they run.
"""

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from strata.kernels import cpu_attention, cpu_kv_cache, reference
from strata.worker.devices import FP8_MIN_CAPABILITY


@dataclass
class AttentionMetadata:
    """Where each token of a ragged batch reads and writes the paged cache (see kernels.reference)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    # Host-side maxima, when the caller has them: they spare the Triton backend a device sync.
    max_query_len: int | None = None
    max_seq_len: int | None = None
    # The torch backend's per-step index work by sliding window (None = full attention), built at
    # the first layer with that window and reused by the rest.
    reference_plans: dict[int | None, reference.AttentionPlan] = field(default_factory=dict)
    # The C backend's: the chunks it leaves to torch's fused attention, by sliding window.
    long_chunks: dict[int | None, list[reference.Chunk]] = field(default_factory=dict)


class AttentionBackend(Protocol):
    """What the model needs from an attention backend (the classes below implement it)."""

    name: str  # "cpu" for the C kernels, whose decode steps a layer may fuse
    # Whether a step's forward can be captured in a CUDA graph: no host syncs while it runs.
    graph_capturable: bool

    @staticmethod
    def cache_dtype(model_dtype: torch.dtype) -> torch.dtype:
        """The cache dtype it keeps for a model of ``model_dtype`` unless told otherwise."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """The torch reference kernels: the oracle, and the CPU path where the C kernels cannot build."""

    name = "torch"
    graph_capturable = False  # planning a step reads the block tables back to the host

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, KVH, D]``; returns ``[T, H, D]``."""
        reference.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        plan = meta.reference_plans.get(sliding_window)
        if plan is None:
            plan = meta.reference_plans[sliding_window] = reference.plan_attention(
                meta.block_tables, meta.query_start_loc, meta.seq_lens, kv_cache.shape[2], sliding_window
            )
        return reference.paged_attention(
            query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, plan, sliding_window
        )

    @staticmethod
    def cache_dtype(model_dtype: torch.dtype) -> torch.dtype:
        """float32: the reference attends in float32, and on CPU converting a bf16 cache to
        float32 at every layer costs more than the memory it saves."""
        return torch.float32


class CpuAttentionBackend:
    """The C kernel compiled for this CPU (kernels/csrc): the CPU path where a C compiler exists.
    Attention shapes the kernel does not handle run the torch reference instead. Chunks of at
    least ``LONG_CHUNK_TOKENS`` new tokens are GEMMs, where the paged kernel's single pass over
    the cache (what memory-bound decodes want) is slow: they run ``cpu_attention.chunk_attention``
    (``vdpbf16ps`` in bfloat16 on a CPU with AVX512-BF16, about 1.7x torch's fused attention on
    EPYC-Zen4; float32 arithmetic elsewhere, about 1.4x torch's on Xeon-AVX512), and torch's
    fused attention only where that kernel cannot run."""

    LONG_CHUNK_TOKENS = 64

    name = "cpu"
    graph_capturable = False  # host kernels

    def __init__(self) -> None:
        if not cpu_attention.is_available():
            raise RuntimeError("the cpu attention backend needs a C compiler (see kernels.native); use --attention-backend torch")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, KVH, D]``; returns ``[T, H, D]``."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        if not cpu_attention.supports(query.shape[1], num_kv_heads, head_dim, block_size):
            # The whole cache stays in the reference's layout: every layer of a model has one shape.
            reference.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
            return reference.paged_attention(
                query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, sliding_window=sliding_window
            )
        cpu_kv_cache.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        long_chunks = meta.long_chunks.get(sliding_window)
        if long_chunks is None:
            long_chunks = meta.long_chunks[sliding_window] = reference.plan_chunks(
                meta.block_tables, meta.query_start_loc, meta.seq_lens, block_size, sliding_window, self.LONG_CHUNK_TOKENS,
                slice_masked=False,  # the C kernels skip what each row does not see
            )
        out = cpu_attention.paged_attention(
            query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            sliding_window=sliding_window, long_chunk_tokens=self.LONG_CHUNK_TOKENS if long_chunks else None,
        )
        for chunk in long_chunks:
            if not cpu_attention.chunk_attention(
                query[chunk.rows], kv_cache, chunk.blocks, chunk.context, scale, out[chunk.rows], sliding_window
            ):
                # Its blocks alone, the keys untiled (csrc/kv_layout.h), for the reference.
                blocks = cpu_kv_cache.untile_keys(kv_cache[:, chunk.blocks])
                chunk = replace(chunk, blocks=torch.arange(len(chunk.blocks)))
                reference.chunk_attention(query, blocks, chunk, scale, out)
        return out

    @staticmethod
    def cache_dtype(model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype


class TritonAttentionBackend:
    """The Triton kernels: the CUDA path (and, under ``TRITON_INTERPRET=1``, a CPU test path)."""

    name = "triton"
    graph_capturable = True

    def __init__(self) -> None:
        # Imported here so that the torch path never needs Triton to compile anything.
        from strata.kernels import triton_attention, triton_kv_cache

        self._attention = triton_attention
        self._kv_cache = triton_kv_cache

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, H, D]``, ``key``/``value`` ``[T, KVH, D]``; returns ``[T, H, D]``."""
        if key.dtype != kv_cache.dtype:  # rounded by torch, as the reference rounds them
            key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        self._kv_cache.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        return self._attention.paged_attention(
            query,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window=sliding_window,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )

    @staticmethod
    def cache_dtype(model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype


_BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend, "triton": TritonAttentionBackend}


def get_attention_backend(
    name: str | None, device: torch.device
) -> TorchAttentionBackend | CpuAttentionBackend | TritonAttentionBackend:
    """The backend called ``name``; ``None`` picks Triton on CUDA, else the C kernel where it
    builds, else the torch reference."""
    if name is None:
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if cpu_attention.is_available() else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def named_cache_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--kv-cache-dtype`` value other than ``"auto"``."""
    return torch.float8_e4m3fn if name == "fp8" else getattr(torch, name)


def kv_cache_dtype(
    backend: AttentionBackend, model_dtype: torch.dtype, requested: str, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype: ``requested`` (``--kv-cache-dtype``: a ``torch`` dtype's name, or
    ``"fp8"`` for float8 e4m3), or where that is ``"auto"`` the one ``backend`` keeps for
    ``model_dtype``. Every backend attends over any of them, converting as it loads; Triton
    compiles float8 e4m3 only for GPUs of compute capability >= 8.9."""
    if requested == "auto":
        return backend.cache_dtype(model_dtype)
    dtype = named_cache_dtype(requested)
    if dtype == torch.float8_e4m3fn and backend.name == "triton" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"--kv-cache-dtype fp8 on the triton attention backend needs a GPU of compute capability >= 8.9, "
                f"and {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; "
                "--kv-cache-dtype bfloat16 or float16 runs on it"
            )
    return dtype
