"""The CPU's LoRA delta kernels (``kernels/cpu_lora.py`` in C, ``kernels/lora.py`` in torch where
C did not build) against their per-slot torch reference."""

import numpy as np
import pytest
import torch

from strata.kernels import cpu_lora, reference
from strata.worker.lora import LoRAPool, LoRAStep

NUM_SLOTS, MAX_RANK, IN_FEATURES, PART_ROWS = 3, 8, 24, [16, 8, 8]


def random_adapter(rank: int, targeted: list[bool], seed: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rank, IN_FEATURES, generator=generator), torch.randn(rows, rank, generator=generator)) if hit else None
        for rows, hit in zip(PART_ROWS, targeted)
    ]


@pytest.fixture(params=["C", "torch"])
def kernel(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each CPU path: the C kernel (where it builds), then the torch GEMMs."""
    if request.param == "C" and not cpu_lora.supported():
        pytest.skip("no C compiler to build the CPU kernels")
    if request.param == "torch":
        monkeypatch.setattr(cpu_lora, "supported", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_token_gets_the_delta_of_its_slots_adapter_and_base_tokens_none(kernel: str, dtype: torch.dtype):
    step = LoRAStep(NUM_SLOTS, MAX_RANK, dtype, torch.device("cpu"))
    pool = LoRAPool(step, PART_ROWS, [slice(0, rows) for rows in PART_ROWS], slice(0, IN_FEATURES))
    # Slot 0: full rank, every part; slot 2: rank 3 (padded), the middle part untouched; slot 1 empty.
    adapters = {0: random_adapter(MAX_RANK, [True, True, True], seed=1), 2: random_adapter(3, [True, False, True], seed=2)}
    scales = {0: 0.5, 2: 2.0}
    for slot, parts in adapters.items():
        pool.load(slot, pool.slot_weights(parts, scales[slot]))
    token_slots = np.array([2, -1, 0, 0, 2, -1, 2])
    x = torch.randn(len(token_slots), IN_FEATURES).to(dtype)
    base = torch.randn(len(token_slots), sum(PART_ROWS)).to(dtype)
    step.begin(token_slots)
    got = pool.apply(x, base.clone())
    expected = base.float() + reference.lora_delta(x, torch.from_numpy(token_slots), adapters, scales, PART_ROWS)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.1)
    torch.testing.assert_close(got.float(), expected, **tolerance)


def test_a_step_without_adapter_rows_leaves_the_output_alone(kernel: str):
    step = LoRAStep(NUM_SLOTS, MAX_RANK, torch.float32, torch.device("cpu"))
    pool = LoRAPool(step, PART_ROWS, [slice(0, rows) for rows in PART_ROWS], slice(0, IN_FEATURES))
    pool.load(0, pool.slot_weights(random_adapter(MAX_RANK, [True] * 3, seed=1), 1.0))
    step.begin(np.array([-1, -1]))
    y = torch.randn(2, sum(PART_ROWS))
    assert not step.active
    assert pool.apply(torch.randn(2, IN_FEATURES), y) is y


def test_a_merged_linears_b_holds_each_parts_columns_once():
    # Compact B: no zeros beside each part's block, so qkv's B is no larger than o's would be.
    step = LoRAStep(NUM_SLOTS, MAX_RANK, torch.float32, torch.device("cpu"))
    pool = LoRAPool(step, PART_ROWS, [slice(0, rows) for rows in PART_ROWS], slice(0, IN_FEATURES))
    assert pool.b.shape == (NUM_SLOTS * MAX_RANK, sum(PART_ROWS))
    assert pool.a.shape == (IN_FEATURES, len(PART_ROWS) * NUM_SLOTS * MAX_RANK)
