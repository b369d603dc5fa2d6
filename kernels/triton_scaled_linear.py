"""A Triton GEMM over 8-bit weights with one scale per output row (``--quantization int8`` and
``fp8-weight-only``): ``y = x (W_q * scale[:, None])^T + b``.

Each weight tile is read in its 8 bits and converted to the activations' dtype in registers,
which is exact (int8 and float8_e4m3fn values all fit in bfloat16, float16 and float32), so the
weight bytes read per step are a quarter of float32's and half of bfloat16's. The scale is
applied to the float32 sums once per output, not per product. Its reference is
``kernels.reference.scaled_linear``.
"""

import torch
import triton
import triton.language as tl

from strata.kernels.triton_attention import dot_dtype


@triton.jit
def _scaled_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        # The weight tile [BLOCK_N, BLOCK_K] is read along its rows (K contiguous) and transposed
        # in registers for the dot product.
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
        # fp32 inputs: three TF32 passes, about as accurate as fp32 FMAs (as in triton_attention).
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision="tf32x3")
    acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _tiles(rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) for a step of ``rows`` rows: decode steps read the weights
    once over narrow column tiles, so that many programs share the bandwidth; larger steps reuse
    each weight tile over more rows."""
    if rows <= 16:
        return 16, 64, 128, 4
    if rows <= 64:
        return 64, 64, 64, 4
    return 128, 128, 64, 8


def scaled_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K]`` times the 8-bit ``weight [N, K]`` (int8 or float8_e4m3fn, row-major) scaled by
    the float32 ``scale [N]``, plus ``bias [N]``; the result ``[M, N]`` in ``x``'s dtype."""
    assert weight.dtype in (torch.int8, torch.float8_e4m3fn) and scale.dtype == torch.float32
    x = x.contiguous()
    weight = weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k and scale.shape == (n,)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_linear_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, DOT_DTYPE=dot_dtype(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return out
