"""LoRA deltas on the CPU (``csrc/lora.c``): each token multiplies only its own slot's A and B,
in ``kernels/lora.py``'s slot layout, so a step costs the adapters' own multiply-adds rather than
the torch path's GEMMs against every slot. Tested against ``reference.lora_delta``.
"""

import ctypes

import torch

from strata.kernels import native

MAX_PARTS = 3


class LoraPoolStruct(ctypes.Structure):
    """``struct LoraPool`` of ``csrc/kernels.h``: a linear's slots, pointing into its tensors."""

    _fields_ = [
        ("parts", ctypes.c_int32),
        ("slots", ctypes.c_int32),
        ("max_rank", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("in_features", ctypes.c_int64),
        ("rows", ctypes.c_int64 * MAX_PARTS),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
    ]


def supported() -> bool:
    """Whether the C kernels built on this machine."""
    return native.load_library() is not None


def pool_struct(a: torch.Tensor, b: torch.Tensor, part_rows: list[int], num_slots: int, max_rank: int) -> LoraPoolStruct:
    """The kernel's view of slots ``a`` ``[in_features, parts * slots * max_rank]`` and ``b``
    ``[slots * max_rank, sum(part_rows)]`` (``kernels/lora.py``'s layout); they must outlive it."""
    if not 1 <= len(part_rows) <= MAX_PARTS:
        raise ValueError(f"a LoRA pool has 1 to {MAX_PARTS} parts, got {len(part_rows)}")
    if a.shape[1] != len(part_rows) * num_slots * max_rank or b.shape != (num_slots * max_rank, sum(part_rows)):
        raise ValueError(f"LoRA slots of shapes {list(a.shape)} and {list(b.shape)} do not match their layout")
    if a.dtype != b.dtype or a.dtype not in native.DTYPE_CODES or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("a LoRA pool's A and B are contiguous CPU tensors of one float dtype")
    return LoraPoolStruct(
        len(part_rows), num_slots, max_rank, native.DTYPE_CODES[a.dtype], a.shape[0],
        (ctypes.c_int64 * MAX_PARTS)(*part_rows), a.data_ptr(), b.data_ptr(),
    )


def add_lora(y: torch.Tensor, x: torch.Tensor, pool: LoraPoolStruct, token_slots: torch.Tensor) -> torch.Tensor:
    """``y[t] += x[t] A_s^T B_s^T`` for every token ``t`` with slot ``s = token_slots[t]`` (int64;
    -1: none), in place, rounded once to ``y``'s dtype; returns ``y``. ``y`` ``[T, out_features]``
    and ``x`` ``[T, in_features]`` contiguous, in float dtypes."""
    if not (y.is_contiguous() and x.is_contiguous() and token_slots.dtype == torch.int64 and token_slots.is_contiguous()):
        raise ValueError("add_lora needs contiguous x and y and int64 token slots")
    status = native.load_library().lora_add(
        ctypes.byref(pool), x.data_ptr(), native.DTYPE_CODES[x.dtype], x.shape[0], token_slots.data_ptr(),
        y.data_ptr(), native.DTYPE_CODES[y.dtype], torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the LoRA kernel could not allocate its per-thread rows")
    return y
