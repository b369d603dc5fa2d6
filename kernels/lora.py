"""Adding LoRA deltas to a linear's output for a batch whose tokens use different adapters
(on the CPU; ``kernels/triton_lora.py`` is the GPU's gathered form of the same product).

Layout (``worker/lora.py`` keeps it): a linear with ``P`` parts (q/k/v, gate/up, or one) of
``part_rows`` output columns each and a pool of ``S`` slots of rank up to ``R`` holds every
slot's A stacked as ``a`` ``[in_features, P * S * R]`` (column ``(p, s, r)``: row ``r`` of slot
``s``'s A for part ``p``, zero beyond the adapter's rank) and every B as ``b``
``[S * R, out_features]`` (row ``(s, r)`` holds column ``r`` of each part's B, times the
adapter's scale, in that part's output columns: the parts side by side as in the linear's
weight, no zeros between them). ``mask`` ``[T, S * R]`` is 1 where a column's slot is token
``t``'s slot, 0 elsewhere (all 0 for a base-model token); the step builds it once.

Then ``y[:, part p] += ((x @ a)[:, part p] * mask) @ b[:, part p]`` is every token's own delta:
a shrink GEMM, a multiply and an expand GEMM per part, whatever the mix of adapters, on the
machine's BLAS. The cost is the shrink over all ``S`` slots, ``P S R`` columns, small beside
the linear itself while ``P S R`` is small beside its output width.
"""

import torch


def slot_mask(token_slots: torch.Tensor, num_slots: int, max_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, num_slots * max_rank]``: row ``t`` is 1 on slot ``token_slots[t]``'s columns (none for -1)."""
    column_slot = torch.arange(num_slots, device=token_slots.device).repeat_interleave(max_rank)
    return (token_slots[:, None] == column_slot[None, :]).to(dtype)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, part_rows: list[int]
) -> torch.Tensor:
    """``y`` plus every token's delta, in place (see the module's layout), ``part_rows`` being
    the output columns of each part; returns ``y``. One expand GEMM per part: part ``p``'s
    shrunk columns times its columns of ``b``."""
    shrunk = x.mm(a)
    width = mask.shape[1]
    shrunk.view(x.shape[0], len(part_rows), width).mul_(mask.unsqueeze(1))
    if len(part_rows) == 1:
        return y.addmm_(shrunk, b)
    offset = 0
    for part, rows in enumerate(part_rows):
        columns = slice(offset, offset + rows)
        y[:, columns].addmm_(shrunk[:, part * width : (part + 1) * width], b[:, columns])
        offset += rows
    return y
