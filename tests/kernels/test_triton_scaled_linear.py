"""The 8-bit linears' kernels against the dequantized torch computation
(``kernels.reference``): the Triton weight-only GEMM (compiled on CUDA, else under the Triton
interpreter, see tests/conftest.py) and the FP8 W8A8 GEMM through ``torch._scaled_mm`` (which
also runs on the CPU), and the per-channel quantization against the bound its format implies.

Tolerances (``atol = rtol``, outputs of magnitude ~10): float32 ``1e-4``, only the order of the
float32 sums differs; bfloat16 ``2e-2``, a few ulps of the output, to which both sides round
(the interpreter truncates instead of rounding to nearest)."""

import pytest
import torch

from strata.kernels import reference, scaled_mm, triton_scaled_linear

TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(rows: int, out_features: int, in_features: int, weight_dtype: torch.dtype, dtype: torch.dtype, device: str = DEVICE):
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    weight, scale = reference.quantize_per_channel(torch.randn(out_features, in_features, generator=generator), weight_dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator)
    return x.to(device), weight.to(device), scale.to(device), bias.to(device)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES.values(), ids=WEIGHT_DTYPES)
@pytest.mark.parametrize("dtype", TOLERANCES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,with_bias", [(3, True), (40, False)], ids=["decode_tile_bias", "prefill_tile"])
def test_triton_weight_only_gemm_matches_the_dequantized_linear(weight_dtype, dtype, rows, with_bias):
    # 72 x 200: neither dimension a multiple of a tile, so the masked edges are exercised.
    x, weight, scale, bias = _operands(rows, 72, 200, weight_dtype, dtype)
    bias = bias if with_bias else None
    out = triton_scaled_linear.scaled_linear(x, weight, scale, bias)
    assert out.dtype == dtype
    _assert_close(out, reference.scaled_linear(x, weight, scale, bias))


@pytest.mark.parametrize("input_scale", [None, 0.02], ids=["dynamic_per_token", "static"])
@pytest.mark.parametrize("dtype", TOLERANCES, ids=["fp32", "bf16"])
def test_w8a8_scaled_mm_matches_the_dequantized_fp8_product(input_scale, dtype):
    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("the GPU path runs bfloat16 and float16 models")
    x, weight, scale, bias = _operands(5, 48, 64, torch.float8_e4m3fn, dtype)
    static = None if input_scale is None else torch.tensor(input_scale, device=DEVICE)
    _assert_close(scaled_mm.w8a8_linear(x, weight, scale, bias, static), reference.w8a8_linear(x, weight, scale, bias, static))


@pytest.mark.parametrize("name", WEIGHT_DTYPES)
def test_per_channel_quantization_error_is_within_half_a_step_of_its_format(name):
    # int8: a uniform grid of step `scale`; e4m3: 3 mantissa bits, so a relative half-step of
    # 2**-4 for normal values, and an absolute 2**-10 * scale below them (subnormals).
    weight = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    weight[3] = 0.0  # an all-zero row stays zero
    quantized, scale = reference.quantize_per_channel(weight, WEIGHT_DTYPES[name])
    error = (quantized.float() * scale[:, None] - weight).abs()
    if name == "int8":
        bound = scale[:, None] / 2
    else:
        bound = torch.maximum(weight.abs() * 2**-4, scale[:, None] * 2**-10)
    assert (error <= bound * (1 + 1e-6)).all()
    assert (quantized[3].float() == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES.values(), ids=WEIGHT_DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_compiled_weight_only_gemm_matches_the_dequantized_linear_at_1b_shapes(weight_dtype, rows):
    x, weight, scale, bias = _operands(rows, 8192, 2048, weight_dtype, torch.bfloat16, "cuda")
    _assert_close(triton_scaled_linear.scaled_linear(x, weight, scale, bias), reference.scaled_linear(x, weight, scale, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_w8a8_scaled_mm_on_the_gpu_matches_the_dequantized_fp8_product_at_1b_shapes(rows):
    x, weight, scale, bias = _operands(rows, 8192, 2048, torch.float8_e4m3fn, torch.bfloat16, "cuda")
    _assert_close(scaled_mm.w8a8_linear(x, weight, scale, bias), reference.w8a8_linear(x, weight, scale, bias))
