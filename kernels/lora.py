"""Adding LoRA deltas to a linear's output for a batch whose tokens use different adapters.

Layout (``worker/lora.py`` keeps it): a linear with ``P`` parts (q/k/v, gate/up, or one) and a
pool of ``S`` slots of rank up to ``R`` holds every slot's A stacked as ``a``
``[in_features, P * S * R]`` (column ``(p, s, r)``: row ``r`` of slot ``s``'s A for part ``p``,
zero beyond the adapter's rank) and every B stacked as ``b`` ``[P * S * R, out_features]``
(row ``(p, s, r)`` holds column ``r`` of part ``p``'s B, times the adapter's scale, in part
``p``'s output columns and zero elsewhere). ``mask`` ``[T, S * R]`` is 1 where a column's slot
is token ``t``'s slot, 0 elsewhere (all 0 for a base-model token); the step builds it once.

Then ``y += ((x @ a) * mask) @ b`` is every token's own delta: a shrink GEMM, a multiply and an
expand GEMM per part, whatever the mix of adapters, on the machine's BLAS (or cuBLAS). The cost is the shrink over all ``S`` slots, ``P S R`` columns, small beside the
linear itself while ``P S R`` is small beside its output width.
"""

import torch


def slot_mask(token_slots: torch.Tensor, num_slots: int, max_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, num_slots * max_rank]``: row ``t`` is 1 on slot ``token_slots[t]``'s columns (none for -1)."""
    column_slot = torch.arange(num_slots, device=token_slots.device).repeat_interleave(max_rank)
    return (token_slots[:, None] == column_slot[None, :]).to(dtype)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, part_rows: list[int]
) -> torch.Tensor:
    """``y += ((x @ a) * mask) @ b`` in place (see the module's layout), ``part_rows`` being the
    output rows of each part; returns ``y``. The expand runs per part on B's diagonal blocks,
    skipping the zeros between them (a third of qkv's work)."""
    shrunk = x.mm(a)
    width = mask.shape[1]
    shrunk.view(x.shape[0], len(part_rows), width).mul_(mask.unsqueeze(1))
    if len(part_rows) == 1:
        return y.addmm_(shrunk, b)
    offset = 0
    for part, rows in enumerate(part_rows):
        block = slice(part * width, (part + 1) * width)
        y[:, offset : offset + rows].addmm_(shrunk[:, block], b[block, offset : offset + rows])
        offset += rows
    return y
