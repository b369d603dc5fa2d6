"""LoRA deltas on the GPU: each token reads only its own slot's A and B (``kernels/lora.py``
multiplies every token by every slot and masks; this is its gathered form).

Layout as in ``kernels/lora.py`` (``worker/lora.py`` keeps it): ``a`` ``[in_features, P * S * R]``
(column ``(p, s, r)``), ``b`` ``[S * R, out_features]`` (row ``(s, r)``, part ``p``'s B in its
own output columns ``part_starts[p]:part_starts[p + 1]``), the scale folded into ``b``.

The step sorts its adapter tokens by slot once (``SortedTokens``: base-model tokens are left
out, so they cost nothing). A program takes ``BLOCK_M`` consecutive sorted tokens; being sorted,
they hold a run of slots from the first token's to the last's, usually one or two, and the
program runs one ``tl.dot`` per slot in that run, keeping each row's result only for its own
slot. So the work grows with the number of slots that share a tile, never with the pool's size,
and the grid depends only on the token count the host already knows (no device sync).

Two kernels per linear: the shrink ``x A_s^T`` into ``[n, P, R]`` (float32, one program per
token tile and part) and the expand, which adds ``shrunk B_s^T`` into ``y``'s part columns in
place (one program per token tile, column tile and part; each output element is written by one
program, so no atomics). Ranks are padded to 16 inside the kernels (``tl.dot``'s smallest
operand). Their reference is ``kernels.reference.lora_delta``.
"""

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from strata.kernels.triton_attention import dot_dtype

# Sorted tokens per program: decode steps rarely have more adapter rows than this per slot.
BLOCK_M = 16
# Input features per shrink iteration and output columns per expand program.
BLOCK_K = 64
BLOCK_N = 64


@dataclass(frozen=True)
class SortedTokens:
    """A step's adapter tokens sorted by slot: ``order`` ``[n]`` their token indices, ``slots``
    ``[n]`` their slots (ascending), both int32 on the device."""

    order: torch.Tensor
    slots: torch.Tensor

    @property
    def count(self) -> int:
        return self.order.shape[0]


def sort_tokens(token_slots: np.ndarray, device: torch.device) -> SortedTokens:
    """The tokens of ``token_slots`` that use a slot (not -1), sorted by slot on the host (the
    step's slots are there already) and copied to ``device``."""
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] >= 0].astype(np.int32)
    slots = token_slots[order].astype(np.int32)
    return SortedTokens(
        torch.from_numpy(order).to(device, non_blocking=True), torch.from_numpy(slots).to(device, non_blocking=True)
    )


@triton.jit
def _slot_run(slots_ptr, first, n, BLOCK_M: tl.constexpr):
    """The first and last slot among the sorted tokens ``first : first + BLOCK_M`` (< ``n``)."""
    low = tl.load(slots_ptr + first)
    high = tl.load(slots_ptr + tl.minimum(first + BLOCK_M, n) - 1)
    return low, high


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, order_ptr, slots_ptr, shrunk_ptr,
    n, K, stride_xm, stride_ak,
    NUM_SLOTS: tl.constexpr, NUM_PARTS: tl.constexpr, RANK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_M
    part = tl.program_id(1)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    row_slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    ranks = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    low, high = _slot_run(slots_ptr, first, n, BLOCK_M)
    result = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for slot in range(low, high + 1):
        columns = (part * NUM_SLOTS + slot) * RANK + ranks
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            k = k_start + ks
            x = tl.load(x_ptr + tokens[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
            a = tl.load(a_ptr + k[:, None] * stride_ak + columns[None, :], mask=(k[:, None] < K) & (ranks[None, :] < RANK), other=0.0)
            # fp32 inputs: three TF32 passes, about as accurate as fp32 FMAs (as in triton_attention).
            acc = tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision="tf32x3")
        result = tl.where((row_slots == slot)[:, None], acc, result)
    out = shrunk_ptr + rows[:, None] * (NUM_PARTS * RANK) + part * RANK + ranks[None, :]
    tl.store(out, result, mask=row_ok[:, None] & (ranks[None, :] < RANK))


@triton.jit
def _expand_kernel(
    shrunk_ptr, b_ptr, y_ptr, order_ptr, slots_ptr, part_starts_ptr,
    n, stride_bk, stride_ym,
    NUM_PARTS: tl.constexpr, RANK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_M
    part = tl.program_id(2)
    start = tl.load(part_starts_ptr + part)
    part_rows = tl.load(part_starts_ptr + part + 1) - start
    if tl.program_id(1) * BLOCK_N >= part_rows:
        return  # a column tile beyond this part's width (the grid spans the widest part)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < part_rows
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    row_slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANK
    shrunk = tl.load(
        shrunk_ptr + rows[:, None] * (NUM_PARTS * RANK) + part * RANK + ranks[None, :],
        mask=row_ok[:, None] & rank_ok[None, :], other=0.0,
    )
    low, high = _slot_run(slots_ptr, first, n, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(low, high + 1):
        # Rows of other slots multiply zeros, so each row gathers only its own slot's B.
        own = tl.where((row_slots == slot)[:, None], shrunk, 0.0)
        b = tl.load(
            b_ptr + (slot * RANK + ranks[:, None]) * stride_bk + start + columns[None, :],
            mask=rank_ok[:, None] & column_ok[None, :], other=0.0,
        )
        acc = tl.dot(own.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision="tf32x3")
    out = y_ptr + tokens[:, None] * stride_ym + start + columns[None, :]
    out_mask = row_ok[:, None] & column_ok[None, :]
    y = tl.load(out, mask=out_mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    part_rows: list[int],
    part_starts: torch.Tensor,
    tokens: SortedTokens,
    num_slots: int,
    max_rank: int,
) -> torch.Tensor:
    """``y`` ``[T, out_features]`` plus, in place, each of ``tokens``' (at least one) delta from its slot's
    adapter (see the module's layout); ``part_rows`` the parts' output columns and
    ``part_starts`` ``[P + 1]`` the same as int32 offsets on the device (the parts' first
    columns, then ``out_features``). Returns ``y``."""
    n = tokens.count
    num_parts = len(part_rows)
    x = x.contiguous()
    assert y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    block_r = max(16, triton.next_power_of_2(max_rank))
    dtype = dot_dtype(x.dtype)
    shrunk = torch.empty(n, num_parts * max_rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(triton.cdiv(n, BLOCK_M), num_parts)](
        x, a, tokens.order, tokens.slots, shrunk, n, x.shape[1], x.stride(0), a.stride(0),
        NUM_SLOTS=num_slots, NUM_PARTS=num_parts, RANK=max_rank,
        DOT_DTYPE=dtype, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )
    _expand_kernel[(triton.cdiv(n, BLOCK_M), triton.cdiv(max(part_rows), BLOCK_N), num_parts)](
        shrunk, b, y, tokens.order, tokens.slots, part_starts, n, b.stride(0), y.stride(0),
        NUM_PARTS=num_parts, RANK=max_rank, DOT_DTYPE=dtype, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N,
    )
    return y
