"""The layers the model families share, in torch: RMSNorm fused with its residual add, rotary
embedding with its scalings, the SwiGLU activation, and the split of attention heads across
tensor-parallel ranks.

On the CPU the fused C kernels of ``kernels.cpu_layers`` replace the elementwise ones where
they built (``RMSNorm`` picks them itself; the attention and MLP that rotate and activate pick
them for their own layouts); the torch code here is what those kernels are tested against.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import cpu_layers
from strata.worker.parallel_state import TensorParallel


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, fused with the residual add that precedes it."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``; without a residual, ``x`` is the new one.
        The given residual may be overwritten (the C kernel adds into it)."""
        if cpu_layers.handles(x):
            return cpu_layers.rms_norm(x, residual, self.weight, self.eps)
        return rms_norm(x, residual, self.weight, self.eps)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * norm(x + residual), x + residual)``, the norm computed in float32."""
    if residual is not None:
        x = x + residual
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rope_inverse_frequencies(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim / 2]`` (float32) after the rope scaling of ``params``
    (``ModelConfig.rope_parameters``, or one layer type's entry of it)."""
    theta = params["rope_theta"]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / theta**exponents
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(
            inv_freq, params["factor"], params["low_freq_factor"], params["high_freq_factor"],
            params["original_max_position_embeddings"],
        )
    raise ValueError(f"rope scaling {rope_type!r} is not supported (supported: default, linear, llama3)")


def _llama3_scaling(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max: int
) -> torch.Tensor:
    # Wavelengths much shorter than the pre-training context keep their frequency, much longer
    # ones are slowed down by `factor`, and the band in between is interpolated linearly.
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """Cosines and sines of each token's position, computed per batch (no length-bound cache)."""

    def __init__(self, rope_parameters: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(rope_parameters, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin``, each ``[T, head_dim / 2]`` in float32."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``: dimension ``i`` pairs with ``i + head_dim / 2`` (HF
    layout), with ``cos``/``sin`` rounded to ``x``'s dtype first as HF does."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def partition_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[slice, slice]:
    """This rank's query heads and the KV heads they read.

    KV heads are dealt out in contiguous runs, each with its whole group of query heads, so a
    model whose head counts do not divide by the TP size still splits (SmolLM2's 9 query and 3
    KV heads over 2 ranks: 3 + 6 query heads). With fewer KV heads than ranks, each KV head is
    replicated on the ranks that split its query group.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv_start, kv_stop = tp.rank * num_kv_heads // tp.size, (tp.rank + 1) * num_kv_heads // tp.size
        return slice(kv_start * group, kv_stop * group), slice(kv_start, kv_stop)
    ranks_per_kv = tp.size // num_kv_heads
    if tp.size % num_kv_heads or group % ranks_per_kv:
        raise ValueError(
            f"{num_heads} query / {num_kv_heads} KV heads cannot be split across {tp.size} ranks"
        )
    kv_head, part = divmod(tp.rank, ranks_per_kv)
    per_rank = group // ranks_per_kv
    q_start = kv_head * group + part * per_rank
    return slice(q_start, q_start + per_rank), slice(kv_head, kv_head + 1)
