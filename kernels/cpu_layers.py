"""The fused elementwise parts of a decoder layer on the CPU (``csrc/layers.c``): RMSNorm with
its residual add, rotary embedding in place, SwiGLU, and the dtype conversion around a linear
whose weights are held wider than its activations. ``worker/layers.py`` holds the torch code
they replace on the CPU and are tested against (``Tensor.to`` for the conversion)."""

import torch

from strata.kernels import native


def handles(x: torch.Tensor) -> bool:
    """Whether these kernels can run on ``x``: a CPU tensor of a supported dtype, on a machine
    where the C kernels built."""
    return x.device.type == "cpu" and x.dtype in native.DTYPE_CODES and native.load_library() is not None


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * norm(x + residual), x + residual)`` over the last dimension; the sum is written
    into ``residual`` in place (without a residual, ``x`` itself is the second result)."""
    _require_contiguous(x, weight, *([residual] if residual is not None else []))
    width = x.shape[-1]
    if weight.shape != (width,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{width}] of {x.dtype}, got {list(weight.shape)} of {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    out = torch.empty_like(x)
    native.load_library().rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // width,
        width,
        native.DTYPE_CODES[x.dtype],
        eps,
        torch.get_num_threads(),
    )
    return out, x if residual is None else residual


def rotary_embedding_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate in place the first ``num_heads`` heads of each row of ``x`` ``[T, >= num_heads *
    head_dim]`` (rows may be strided); ``cos``/``sin`` are float32 ``[T, head_dim / 2]``."""
    if x.stride(1) != 1 or x.shape[1] < num_heads * head_dim:
        raise ValueError("x must be [tokens, >= num_heads * head_dim] with contiguous rows")
    _require_contiguous(cos, sin)
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != (x.shape[0], head_dim // 2):
        raise ValueError("cos and sin must be float32 [tokens, head_dim / 2]")
    native.load_library().rotary_embedding(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        num_heads,
        head_dim,
        native.DTYPE_CODES[x.dtype],
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    _require_contiguous(gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension ({gate_up.shape[-1]}) must be even: [gate | up]")
    width = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype)
    native.load_library().silu_and_mul(
        gate_up.data_ptr(), out.data_ptr(), out.numel() // width, width, native.DTYPE_CODES[gate_up.dtype], torch.get_num_threads()
    )
    return out


def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, rounded as torch rounds, on one thread below a million elements (torch
    wakes every thread for a decode step's few hundred thousand)."""
    _require_contiguous(x)
    if dtype not in native.DTYPE_CODES:
        raise ValueError(f"cannot convert to {dtype}; supported: {', '.join(map(str, native.DTYPE_CODES))}")
    out = torch.empty(x.shape, dtype=dtype)
    native.load_library().convert(
        x.data_ptr(), native.DTYPE_CODES[x.dtype], out.data_ptr(), native.DTYPE_CODES[dtype], x.numel(),
        torch.get_num_threads(),
    )
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.max(dim=-1).indices`` of a float32 ``[rows, cols]`` ``x``: each row's first largest
    value's index (a NaN's, the first, where the row has one), as int64."""
    _require_contiguous(x)
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"argmax needs float32 [rows, cols], got {list(x.shape)} of {x.dtype}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    native.load_library().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def _require_contiguous(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError("the fused CPU layer kernels need contiguous tensors")
