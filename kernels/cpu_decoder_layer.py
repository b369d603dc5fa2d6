"""A Llama decoder layer's attention and MLP halves as one C call each, for the few rows of a
decode step on the CPU (``csrc/decoder_layer.c``), for ``worker/fused_decode_layers.py``. They
run the kernels the module path of ``worker/llama.py`` runs, in its order, so they return
exactly what it returns.

The weights a layer points at are described once (``AttentionLayer``, ``MlpLayer``); a step's
rows, rotary angles and cache addressing once per step (``DecodeStep``).
"""

import ctypes
from dataclasses import dataclass

import torch

from strata.kernels import gguf_linear, native

_i32, _i64, _ptr, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

# csrc/decoder_layer.c's status codes.
_NO_MEMORY, _SLOT_OUTSIDE_CACHE, _UNSUPPORTED_SHAPE = -1, -2, -3


class LayerWeight(ctypes.Structure):
    """A linear's weight: the address of the matrix it streams (bfloat16 or float32, by its
    ``native.DTYPE_CODES`` code), or a ``gguf_linear.QuantizedMatrix``'s struct."""

    _fields_ = [("streamed", _ptr), ("quantized", ctypes.POINTER(gguf_linear.MatrixStruct)), ("streamed_dtype", _i32)]


class AttentionLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr), ("qkv", LayerWeight), ("qkv_bias", _ptr), ("o_proj", LayerWeight),
        ("hidden", _i32), ("heads", _i32), ("kv_heads", _i32), ("head_dim", _i32), ("sliding_window", _i32),
        ("eps", _f32), ("scale", _f32),
    ]


class MlpLayer(ctypes.Structure):
    _fields_ = [
        ("post_attention_norm", _ptr), ("gate_up", LayerWeight), ("gate_up_bias", _ptr), ("down", LayerWeight),
        ("hidden", _i32), ("intermediate", _i32), ("eps", _f32),
    ]


class DecodeStep(ctypes.Structure):
    _fields_ = [
        ("rows", _i64), ("dtype", _i32), ("num_threads", _i32), ("cos", _ptr), ("sin", _ptr),
        ("slot_mapping", _ptr), ("block_tables", _ptr), ("block_table_stride", _i64),
        ("query_start_loc", _ptr), ("seq_lens", _ptr), ("num_seqs", _i32),
    ]


class KvCache(ctypes.Structure):
    _fields_ = [("data", _ptr), ("num_blocks", _i64), ("block_size", _i32), ("dtype", _i32)]


@dataclass
class Step:
    """A ``DecodeStep`` and the tensors it points into, kept alive with it."""

    struct: DecodeStep
    tensors: tuple[torch.Tensor, ...]


def decode_step(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> Step | None:
    """The step's shared arguments for ``hidden`` ``[rows, hidden]``, or None when the fused halves
    do not take it: tensors off the CPU, of another dtype or layout than the module path would
    hand the kernels. (Whether the layers' linears take that many rows is the caller's check:
    ``FusedDecoderLayer.max_rows``.)"""
    if (
        hidden.device.type != "cpu"
        or hidden.dim() != 2
        or hidden.dtype not in native.DTYPE_CODES
        or not hidden.is_contiguous()
        or native.load_library() is None
    ):
        return None
    tensors = (cos, sin, slot_mapping, block_tables, query_start_loc, seq_lens)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    if (cos.dtype, sin.dtype, slot_mapping.dtype) != (torch.float32, torch.float32, torch.int64):
        return None
    if (block_tables.dtype, query_start_loc.dtype, seq_lens.dtype) != (torch.int32,) * 3:
        return None
    struct = DecodeStep(
        rows=hidden.shape[0],
        dtype=native.DTYPE_CODES[hidden.dtype],
        num_threads=torch.get_num_threads(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        slot_mapping=slot_mapping.data_ptr(),
        block_tables=block_tables.data_ptr(),
        block_table_stride=block_tables.stride(0),
        query_start_loc=query_start_loc.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        num_seqs=seq_lens.numel(),
    )
    return Step(struct, tensors)


def kv_cache(cache: torch.Tensor) -> KvCache:
    """The C view of a layer's contiguous paged cache ``[2, blocks, block_size, kv_heads, head_dim]``."""
    if not cache.is_contiguous() or cache.dtype not in native.CACHE_DTYPE_CODES:
        raise ValueError("the fused layer needs a contiguous KV cache of a supported dtype")
    return KvCache(cache.data_ptr(), cache.shape[1], cache.shape[2], native.CACHE_DTYPE_CODES[cache.dtype])


def attention_block(
    layer: AttentionLayer, step: Step, cache: KvCache, hidden: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor | None:
    """``o_proj(attention(...))`` of ``hidden`` (see ``csrc/decoder_layer.c``), the residual sum
    written into ``residual`` (None: ``hidden`` is the residual). Returns None, having changed
    nothing, when the attention kernel does not take the cache's block size."""
    out = torch.empty_like(hidden)
    status = native.load_library().attention_block(
        ctypes.byref(layer), ctypes.byref(step.struct), ctypes.byref(cache), hidden.data_ptr(),
        None if residual is None else residual.data_ptr(), out.data_ptr(),
    )
    if status == _UNSUPPORTED_SHAPE:
        return None
    _raise_for(status)
    return out


def mlp_block(layer: MlpLayer, step: Step, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` of the normed ``hidden + residual``, the sum written into ``residual``."""
    out = torch.empty_like(hidden)
    status = native.load_library().mlp_block(
        ctypes.byref(layer), ctypes.byref(step.struct), hidden.data_ptr(), residual.data_ptr(), out.data_ptr()
    )
    _raise_for(status)
    return out


@dataclass
class Stack:
    """Every layer's halves of a stage, as the C arrays ``decoder_stack`` walks."""

    attention: ctypes.Array
    mlp: ctypes.Array

    @classmethod
    def of(cls, attention: list[AttentionLayer], mlp: list[MlpLayer]) -> "Stack":
        return cls((AttentionLayer * len(attention))(*attention), (MlpLayer * len(mlp))(*mlp))


def kv_caches(caches: list[torch.Tensor]) -> ctypes.Array:
    """The C views of the layers' caches (``kv_cache``), as one array."""
    return (KvCache * len(caches))(*map(kv_cache, caches))


def decoder_stack(
    stack: Stack, step: Step, caches: ctypes.Array, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every layer of ``stack`` on one rank in one call: the last layer's output and the residual
    it has not been added to (``residual``, or ``hidden`` when None, updated in place), as a loop
    of ``attention_block`` and ``mlp_block`` would give them; None, having changed nothing, when
    the attention kernel does not take the caches' block size."""
    out = torch.empty_like(hidden)
    status = native.load_library().decoder_stack(
        stack.attention, stack.mlp, caches, len(stack.attention), ctypes.byref(step.struct), hidden.data_ptr(),
        None if residual is None else residual.data_ptr(), out.data_ptr(),
    )
    if status == _UNSUPPORTED_SHAPE:
        return None
    _raise_for(status)
    return out, hidden if residual is None else residual


def _raise_for(status: int) -> None:
    if status == _SLOT_OUTSIDE_CACHE:
        raise IndexError("slot_mapping points outside the KV cache")
    if status == _NO_MEMORY:
        raise MemoryError("the fused decoder layer could not allocate its scratch buffers")
