"""The small-batch linear (``kernels.cpu_linear``) equals ``F.linear`` in float32 on the same
bfloat16 or float32 weights, rounded once to the output dtype.

Tolerances: a float32 output differs only in summation order (``1e-5`` relative, outputs of
magnitude ~1); a bfloat16 output by at most the ulp such a difference tips over (``1.6e-2``).
"""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import cpu_linear, native

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the CPU kernels")

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def weights(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    return (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), bias).to(out_dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])  # every block layout and their partial blocks
@pytest.mark.parametrize("out_features", [1, 6, 64, 131])  # partial groups of 2 and 4 features
@pytest.mark.parametrize("in_features", [96, 80])  # whole runs of 32 pairs, and a half run at the end
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weights", "fp32-weights"])
@pytest.mark.parametrize("portable", [False, True], ids=["best-body", "portable-body"])
def test_matches_float32_linear(
    rows: int, out_features: int, in_features: int, x_dtype: torch.dtype, weight_dtype: torch.dtype, portable: bool
) -> None:
    weight = weights(out_features, in_features, weight_dtype)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(x_dtype)
    tol = TOLERANCES[x_dtype]
    out = cpu_linear.small_batch_linear(x, weight, portable=portable)
    torch.testing.assert_close(out, expected(x, weight, None, x_dtype), atol=tol, rtol=tol)


@pytest.mark.parametrize("portable", [False, True], ids=["best-body", "portable-body"])
def test_bias_is_added_and_the_output_dtype_can_differ_from_the_input(portable: bool) -> None:
    weight, bias = weights(40, 64), torch.randn(40)
    x = torch.randn(3, 64).bfloat16()
    out = cpu_linear.small_batch_linear(x, weight, bias, out_dtype=torch.float32, portable=portable)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected(x, weight, bias, torch.float32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("rows", "in_features", "weight_dtype"),
    [(cpu_linear.MAX_ROWS + 1, 64, torch.bfloat16), (2, 56, torch.float32), (2, 64, torch.float16)],
    ids=["too-many-rows", "input-not-a-multiple-of-16", "float16-weight"],
)
def test_what_it_does_not_take_is_refused(rows: int, in_features: int, weight_dtype: torch.dtype) -> None:
    x, weight = torch.randn(rows, in_features), torch.randn(8, in_features).to(weight_dtype)
    assert not cpu_linear.supports(x, weight)
    with pytest.raises(ValueError, match="small_batch_linear needs"):
        cpu_linear.small_batch_linear(x, weight)
