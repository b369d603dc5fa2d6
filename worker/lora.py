"""LoRA adapters inside the linears: each adaptable linear holds a pool of adapter slots and
adds, per token, the delta of the adapter in that token's slot: ``kernels/cpu_lora.py`` (C) on
the CPU, ``kernels/triton_lora.py`` on CUDA devices, ``kernels/lora.py`` (torch) where the C
kernels did not build.

Every pool of a model reads one ``LoRAStep``: the step's token -> slot layout, which the model
runner sets before each forward. A step without adapter rows leaves it empty and the pools do
nothing, so base-only batches pay nothing (and keep the fused CPU decode layers and CUDA graphs).

Sharding follows the linear: a column-parallel linear (q/k/v, gate/up) holds every part's A
whole and this rank's output rows of its B; a row-parallel one (o, down) this rank's input
columns of A and B whole, and adds its delta to the partial sum before the all-reduce (the
delta is linear in ``x``, so the reduce sums the ranks' partial deltas into the whole one).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from strata.kernels import cpu_lora, lora
from strata.worker.input_batch import to_device
from strata.worker.llama import OtherStageLayer
from strata.worker.tp_layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:  # Triton is imported where its kernels run, on CUDA: loading it costs a CPU worker ~0.7 s
    from strata.kernels.triton_lora import SortedTokens

# Each adaptable linear of a decoder layer, by its path in the layer, and the checkpoint
# linears (an adapter's target modules) it merges, in part order.
LORA_LINEARS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class LoRAStep:
    """The current step's token -> slot layout, shared by every pool of a model, while the step
    has adapter rows: on CUDA devices its adapter tokens sorted by slot
    (``triton_lora.SortedTokens``), on the CPU each token's slot (``token_slots``, for the C
    kernel), or where that did not build the slot ``mask`` (``kernels.lora.slot_mask``)."""

    num_slots: int
    max_rank: int
    dtype: torch.dtype
    device: torch.device
    mask: torch.Tensor | None = None
    tokens: "SortedTokens | None" = None
    token_slots: torch.Tensor | None = None

    @property
    def runs_c_kernel(self) -> bool:
        return self.device.type == "cpu" and cpu_lora.supported()

    def begin(self, token_slots: np.ndarray) -> None:
        """Set the layout of a step whose tokens use ``token_slots`` (-1: the base model)."""
        self.mask = self.tokens = self.token_slots = None
        if (token_slots < 0).all():
            return
        if self.device.type == "cuda":
            from strata.kernels import triton_lora

            self.tokens = triton_lora.sort_tokens(token_slots, self.device)
        elif self.runs_c_kernel:
            self.token_slots = torch.from_numpy(token_slots.astype(np.int64, copy=False))
        else:
            self.mask = lora.slot_mask(to_device(token_slots, self.device), self.num_slots, self.max_rank, self.dtype)

    @property
    def active(self) -> bool:
        return self.mask is not None or self.tokens is not None or self.token_slots is not None


@dataclass(frozen=True)
class SlotWeights:
    """One adapter's weights for one linear, laid out as a slot of its pool holds them: ``a``
    ``[in_features, parts, max_rank]``, ``b`` ``[max_rank, out_features]`` (each part's B in its
    own output columns; zero-padded beyond the adapter's rank, the scale folded into ``b``, zero
    for parts it does not target)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAPool:
    """One linear's adapter slots (the ``kernels/lora.py`` layout). ``part_rows`` are this
    rank's output rows of each part, ``b_rows`` where they lie in the part's full B, ``a_columns``
    this rank's input features of A (all of them for a column-parallel linear); ``part_starts``
    the parts' first output columns and the width, on the device for the Triton kernels."""

    step: LoRAStep
    part_rows: list[int]
    b_rows: list[slice]
    a_columns: slice
    a: torch.Tensor = field(init=False)
    b: torch.Tensor = field(init=False)
    part_starts: torch.Tensor = field(init=False)
    c_pool: cpu_lora.LoraPoolStruct | None = field(init=False)  # the C kernel's view of a and b

    def __post_init__(self) -> None:
        step = self.step
        slot_rows = step.num_slots * step.max_rank
        in_features = self.a_columns.stop - self.a_columns.start
        self.a = torch.zeros(in_features, len(self.part_rows) * slot_rows, dtype=step.dtype, device=step.device)
        self.b = torch.zeros(slot_rows, sum(self.part_rows), dtype=step.dtype, device=step.device)
        starts = np.cumsum([0, *self.part_rows], dtype=np.int32)
        self.part_starts = torch.from_numpy(starts).to(step.device)
        self.c_pool = None
        if step.runs_c_kernel:
            self.c_pool = cpu_lora.pool_struct(self.a, self.b, self.part_rows, step.num_slots, step.max_rank)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the linear's output for ``x``) plus each token's adapter delta."""
        step = self.step
        if step.tokens is not None:
            from strata.kernels import triton_lora

            return triton_lora.add_lora(
                y, x, self.a, self.b, self.part_rows, self.part_starts, step.tokens, step.num_slots, step.max_rank
            )
        if step.token_slots is not None:
            assert self.c_pool is not None
            return cpu_lora.add_lora(y, x.contiguous(), self.c_pool, step.token_slots)
        if step.mask is not None:
            return lora.add_lora(y, x, self.a, self.b, step.mask, self.part_rows)
        return y

    def slot_weights(self, parts: list[tuple[torch.Tensor, torch.Tensor] | None], scale: float) -> SlotWeights:
        """Lay out one adapter's ``(A, B)`` shards of each part (None: not targeted) for a slot."""
        num_parts, max_rank = len(self.part_rows), self.step.max_rank
        a = torch.zeros(self.a.shape[0], num_parts, max_rank, dtype=self.a.dtype)
        b = torch.zeros(max_rank, self.b.shape[1], dtype=self.b.dtype)
        offset = 0
        for part, (rows, pair) in enumerate(zip(self.part_rows, parts)):
            if pair is not None:
                part_a, part_b = pair
                rank = part_a.shape[0]
                a[:, part, :rank] = part_a.T
                b[:rank, offset : offset + rows] = (part_b.float() * scale).T
            offset += rows
        return SlotWeights(a, b)

    def load(self, slot: int, weights: SlotWeights) -> None:
        """Put an adapter into ``slot``: two copies."""
        num_parts, num_slots, max_rank = len(self.part_rows), self.step.num_slots, self.step.max_rank
        self.a.view(-1, num_parts, num_slots, max_rank)[:, :, slot].copy_(weights.a, non_blocking=True)
        self.b.view(num_slots, max_rank, -1)[slot].copy_(weights.b, non_blocking=True)


@dataclass(frozen=True)
class LoRATarget:
    """An adaptable linear of decoder layer ``layer``: its pool and the target modules of its parts."""

    layer: int
    modules: tuple[str, ...]
    pool: LoRAPool


def attach_lora_pools(model: nn.Module, step: LoRAStep) -> list[LoRATarget]:
    """Give every adaptable linear of the layers this stage holds a pool reading ``step``;
    ValueError where the model's family cannot take adapters."""
    if not model.supports_lora:
        raise ValueError(f"LoRA adapters are not supported for {type(model).__name__} (its experts have no adapter pools)")
    decoder = model.model
    decoder.lora_step = step
    targets = []
    for index, layer in enumerate(decoder.layers):
        if isinstance(layer, OtherStageLayer):
            continue
        for path, modules in LORA_LINEARS.items():
            linear = layer.get_submodule(path)
            linear.lora = _pool_for(linear, step)
            targets.append(LoRATarget(index, modules, linear.lora))
    return targets


def _pool_for(linear: nn.Module, step: LoRAStep) -> LoRAPool:
    if isinstance(linear, ColumnParallelLinear):
        return LoRAPool(step, linear.output_sizes, linear.shards, slice(0, linear.input_size))
    if isinstance(linear, RowParallelLinear):
        return LoRAPool(step, [linear.output_size], [slice(0, linear.output_size)], linear.columns)
    raise ValueError(f"{type(linear).__name__} cannot hold LoRA adapters")
