"""oneDNN's linear on packed weights (``kernels.onednn_linear``) equals ``F.linear`` in float32 on
the same values, rounded once to the weight's dtype."""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import onednn_linear

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # as for the small-batch linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_packed_linear_matches_float32_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    if not onednn_linear.available(dtype):
        pytest.skip(f"torch's oneDNN cannot pack {dtype} weights on this CPU")
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 80, generator=generator) / 80**0.5).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
    out = onednn_linear.linear(x, onednn_linear.pack(weight), bias)
    torch.testing.assert_close(out, expected, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
