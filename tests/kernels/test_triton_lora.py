"""The Triton LoRA kernels (``kernels/triton_lora.py``, compiled on CUDA, else under the Triton
interpreter, see tests/conftest.py) against the per-slot torch reference
(``kernels.reference.lora_delta``), on pools laid out by ``worker/lora.py``.

Tolerances: float32 ``1e-4`` (only the order of the sums differs); bfloat16 ``3e-2`` relative to
deltas of magnitude ~10 (the shrunk values are rounded to bfloat16 before the expand)."""

import numpy as np
import pytest
import torch

from strata.kernels import reference, triton_lora
from strata.worker.lora import LoRAPool, LoRAStep

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# q, k, v parts of unequal widths, none a multiple of the kernels' column tile (64).
NUM_SLOTS, MAX_RANK, IN_FEATURES, PART_ROWS = 3, 8, 80, [72, 24, 24]


def random_adapter(rank: int, targeted: list[bool], seed: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rank, IN_FEATURES, generator=generator) / 4, torch.randn(rows, rank, generator=generator)) if hit else None
        for rows, hit in zip(PART_ROWS, targeted)
    ]


def pool_with_adapters(dtype: torch.dtype) -> tuple[LoRAPool, dict, dict]:
    """A pool whose slot 0 holds a full-rank adapter of every part, slot 2 a rank-3 one (padded)
    that leaves the middle part alone, and slot 1 nothing."""
    step = LoRAStep(NUM_SLOTS, MAX_RANK, dtype, DEVICE)
    pool = LoRAPool(step, PART_ROWS, [slice(0, rows) for rows in PART_ROWS], slice(0, IN_FEATURES))
    adapters = {0: random_adapter(MAX_RANK, [True, True, True], seed=1), 2: random_adapter(3, [True, False, True], seed=2)}
    scales = {0: 0.5, 2: 2.0}
    for slot, parts in adapters.items():
        pool.load(slot, pool.slot_weights(parts, scales[slot]))
    return pool, adapters, scales


@pytest.mark.parametrize("dtype", TOLERANCES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "token_slots",
    [
        [2, -1, 0, 0, 2, -1, 2],  # a decode-sized mix, slots interleaved with base tokens
        [0] * 9 + [-1] * 5 + [2] * 20 + [0] * 4,  # a prefill: runs of slots across token tiles
    ],
    ids=["interleaved", "runs_across_tiles"],
)
def test_each_token_gets_the_delta_of_its_own_slots_adapter(dtype, token_slots):
    pool, adapters, scales = pool_with_adapters(dtype)
    token_slots = np.array(token_slots)
    generator = torch.Generator().manual_seed(len(token_slots))
    x = torch.randn(len(token_slots), IN_FEATURES, generator=generator)
    base = torch.randn(len(token_slots), sum(PART_ROWS), generator=generator)
    tokens = triton_lora.sort_tokens(token_slots, DEVICE)
    got = triton_lora.add_lora(
        base.to(DEVICE, dtype, copy=True), x.to(DEVICE, dtype), pool.a, pool.b, pool.part_rows, pool.part_starts, tokens,
        NUM_SLOTS, MAX_RANK,
    )
    expected = base + reference.lora_delta(x.to(dtype), torch.from_numpy(token_slots), adapters, scales, PART_ROWS)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got.float().cpu(), expected, rtol=tolerance, atol=tolerance * 10)


def test_sorted_tokens_leave_out_the_base_models_tokens_and_keep_each_slots_order():
    tokens = triton_lora.sort_tokens(np.array([2, -1, 0, 2, -1, 0]), torch.device("cpu"))
    assert tokens.order.tolist() == [2, 5, 0, 3]
    assert tokens.slots.tolist() == [0, 0, 2, 2]
