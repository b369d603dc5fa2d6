"""A mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a softmax top-k router over SwiGLU experts.

A step groups its tokens by expert with one sort, runs each expert that received tokens once
over its whole group (two matmuls), scales the results by the router weights and adds them back
to their tokens with ``index_add_``. Python loops over the experts that have tokens, never over
tokens.

Tensor parallelism is expert parallel: rank ``r`` holds whole experts, a contiguous run of them,
and computes only the tokens routed to those; the all-reduce that a row-parallel MLP ends with
sums the ranks' partial outputs. ``Experts`` also takes a share of every expert's intermediate
features instead (the dense-MLP split), which the MoE benchmark compares (docs/models.md, "The MoE
benchmark").
"""

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import cpu_layers
from strata.worker.layers import silu_and_mul
from strata.worker.parallel_state import TensorParallel
from strata.worker.tp_layers import TensorSource, copy_shard, empty_parameter, read_shard


def expert_parallel_share(num_experts: int, tp: TensorParallel) -> slice:
    """This rank's experts: contiguous runs whose sizes differ by at most one."""
    return slice(tp.rank * num_experts // tp.size, (tp.rank + 1) * num_experts // tp.size)


class TopKRouter(nn.Module):
    """Softmax over the experts' logits, then the ``top_k`` largest; ``renormalize`` rescales
    those to sum to one (Mixtral always; Qwen3-MoE when ``norm_topk_prob``). Every rank routes
    every token (the router is one small matmul), so all ranks agree on the routing."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.weight = empty_parameter(num_experts, hidden_size)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 routing weights and expert ids, each ``[T, top_k]``."""
        probabilities = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, expert_ids = torch.topk(probabilities, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids


class Experts(nn.Module):
    """This rank's SwiGLU experts, stacked: ``gate_up_proj`` ``[experts, 2 * features, hidden]``
    and ``down_proj`` ``[experts, hidden, features]``.

    Of ``num_experts`` experts with ``intermediate_size`` features each, this rank holds the
    experts (global ids) ``experts`` and the features ``features`` of each. Checkpoints store one
    matrix per expert and projection, named ``<id>.<name>.weight`` with ``names`` the (gate, up,
    down) names; tensors of experts held elsewhere are skipped at load.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        experts: slice,
        features: slice,
        names: tuple[str, str, str],
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.experts = experts
        self.features = features
        self.names = names
        num_local, width = experts.stop - experts.start, features.stop - features.start
        self.gate_up_proj = empty_parameter(num_local, 2 * width, hidden_size)
        self.down_proj = empty_parameter(num_local, hidden_size, width)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert[expert_ids[t, k]](x[t])`` over this rank's experts; the
        other ranks' experts contribute zeros here."""
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()
        # Assignments (token, k) flattened; keep this rank's, grouped by expert in a stable order.
        assignments = torch.arange(flat_ids.numel(), device=x.device)
        if self.experts != slice(0, self.num_experts):
            assignments = assignments[(flat_ids >= self.experts.start) & (flat_ids < self.experts.stop)]
        local_ids = flat_ids[assignments] - self.experts.start
        order = torch.argsort(local_ids, stable=True)
        assignments = assignments[order]
        group_sizes = torch.bincount(local_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        tokens = assignments // top_k
        grouped = x[tokens]
        expert_out = torch.empty_like(grouped)
        start = 0
        for expert, size in enumerate(group_sizes):
            if size:
                rows = slice(start, start + size)
                gate_up = F.linear(grouped[rows], self.gate_up_proj[expert])
                fused = cpu_layers.handles(gate_up)
                activated = cpu_layers.silu_and_mul(gate_up) if fused else silu_and_mul(gate_up)
                torch.matmul(activated, self.down_proj[expert].t(), out=expert_out[rows])
                start += size
        expert_out *= weights.flatten()[assignments].unsqueeze(1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, expert_out)

    def checkpoint_parts(self, param_name: str) -> list[str]:
        """Checkpoint names, relative to this module, of each part of ``param_name``: for
        ``gate_up_proj`` part ``2 e`` is expert ``e``'s gate and ``2 e + 1`` its up matrix; for
        ``down_proj`` part ``e`` is expert ``e``'s down matrix. Every expert, held here or not."""
        gate, up, down = self.names
        if param_name == "gate_up_proj":
            return [f"{e}.{name}.weight" for e in range(self.num_experts) for name in (gate, up)]
        return [f"{e}.{down}.weight" for e in range(self.num_experts)]

    def load_weight(self, param_name: str, source: TensorSource, part: int) -> None:
        """Copy this rank's features of one checkpoint matrix (see ``checkpoint_parts``)."""
        expert, half = divmod(part, 2) if param_name == "gate_up_proj" else (part, 0)
        if not self.experts.start <= expert < self.experts.stop:
            return
        local = expert - self.experts.start
        hidden_size = self.down_proj.shape[1]
        if param_name == "gate_up_proj":
            width = self.features.stop - self.features.start
            shard = read_shard(source, (self.intermediate_size, hidden_size), self.features)
            copy_shard(self.gate_up_proj.data[local, half * width : (half + 1) * width], shard)
        else:
            shard = read_shard(source, (hidden_size, self.intermediate_size), (slice(None), self.features))
            copy_shard(self.down_proj.data[local], shard)


class SparseMoE(nn.Module):
    """Router (``gate``) and experts, with the all-reduce that sums the ranks' partial outputs."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        names: tuple[str, str, str],
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = TopKRouter(num_experts, hidden_size, top_k, renormalize)
        self.experts = Experts(
            hidden_size,
            intermediate_size,
            num_experts,
            experts=expert_parallel_share(num_experts, tp),
            features=slice(0, intermediate_size),
            names=names,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        return self.tp.all_reduce(self.experts(x, weights, expert_ids))
