"""FP8 W8A8 linears through ``torch._scaled_mm`` (``--quantization fp8``): the activations are
quantized to float8_e4m3fn per token (or with a checkpoint's static scale) and the product runs
on FP8 tensor cores, each output scaled by its token's and its weight row's scales. Its
reference is ``kernels.reference.w8a8_linear``."""

import torch

from strata.kernels import reference


def w8a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K]`` times the float8_e4m3fn ``weight [N, K]`` scaled by ``scale [N]`` (float32),
    plus ``bias``; ``x`` is quantized per token, or with ``input_scale`` where given. The result
    is in ``x``'s dtype."""
    x_fp8, x_scale = reference.quantize_activations_fp8(x, input_scale)
    # Row-wise scales (one per token and one per weight row) come out in bfloat16 on CUDA: the
    # scaled GEMM has no float16 output for them.
    out_dtype = torch.bfloat16 if x.dtype == torch.float16 else x.dtype
    y = torch._scaled_mm(
        x_fp8, weight.t(), scale_a=x_scale.contiguous(), scale_b=scale.view(1, -1), out_dtype=out_dtype
    )
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
