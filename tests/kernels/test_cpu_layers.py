"""The fused C layer kernels (``kernels.cpu_layers``) equal the torch code in ``worker/layers.py``.

Tolerances: fp32 ``1e-5`` (summation order, the exponential's last bits); bf16/fp16 one ulp of
the dtype at the values' magnitude (``rtol`` 1/128 and 1/1024), since the kernels round where
the torch code rounds but compute each step in float32 before rounding. Rotary is compared with
the torch code run in float32 and rounded once, as the kernel does.
"""

import pytest
import torch

import kernel_builds
from strata.kernels import cpu_layers
from strata.worker.layers import apply_rotary, rms_norm, silu_and_mul

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1 / 128), torch.float16: (1e-3, 1 / 1024)}
IDS = ["fp32", "bf16", "fp16"]

pytestmark = pytest.mark.skipif(not cpu_layers.handles(torch.empty(1)), reason="no C compiler to build the CPU kernels")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", TOLERANCES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 200], ids=["one_row", "threaded"])
@pytest.mark.parametrize("width", [576, 100], ids=["lanes", "ragged"])
def test_rms_norm_with_residual_matches_torch(layers_build, dtype, rows, width):
    torch.manual_seed(0)
    x, residual = (torch.randn(rows, width).to(dtype) for _ in range(2))
    weight = torch.rand(width).to(dtype)
    expected, expected_sum = rms_norm(x, residual, weight, 1e-5)
    out, new_residual = cpu_layers.rms_norm(x, residual.clone(), weight, 1e-5)
    assert_close(new_residual, expected_sum)
    assert_close(out, expected)


def test_rms_norm_rounds_subnormal_residual_sums_as_torch_does():
    # AVX512-BF16's conversion flushes subnormals to zero; vectors holding one must round as torch.
    torch.manual_seed(0)
    tiny = torch.finfo(torch.float32).tiny
    x, residual = ((torch.randn(3, 576) * tiny / 8).bfloat16() for _ in range(2))
    x[0] = torch.randn(576).bfloat16()  # normal sums, whole vectors of them
    x[1, ::7] = torch.randn(83).bfloat16()  # normal and subnormal sums in each vector
    expected = x + residual
    assert expected[2].abs().max() < tiny and expected[2].ne(0).sum() > 500
    _, new_residual = cpu_layers.rms_norm(x, residual, torch.rand(576).bfloat16(), 1e-6)
    assert torch.equal(new_residual, expected)


def test_rms_norm_adds_into_the_residual_in_place():
    x, residual = torch.ones(2, 32), torch.full((2, 32), 2.0)
    _, new_residual = cpu_layers.rms_norm(x, residual, torch.ones(32), 1e-6)
    assert new_residual.data_ptr() == residual.data_ptr() and residual.eq(3.0).all()


@pytest.mark.parametrize("dtype", TOLERANCES, ids=IDS)
def test_rms_norm_without_residual_returns_x_as_the_residual(layers_build, dtype):
    x, weight = torch.randn(3, 80).to(dtype), torch.rand(80).to(dtype)
    out, new_residual = cpu_layers.rms_norm(x, None, weight, 1e-6)
    assert new_residual is x
    assert_close(out, rms_norm(x, None, weight, 1e-6)[0])


@pytest.mark.parametrize("dtype", TOLERANCES, ids=IDS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("tokens", [37, 300], ids=["one_thread", "threaded"])
def test_rotary_in_place_on_a_strided_qkv_matches_torch(dtype, head_dim, tokens):
    torch.manual_seed(1)
    q_heads, kv_heads = 6, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.arange(tokens).float()[:, None] * torch.rand(head_dim // 2) * 3
    cos, sin = angles.cos(), angles.sin()
    # The torch code rounds cos, sin and each product to the dtype; the kernel rounds once.
    heads = qkv[:, : (q_heads + kv_heads) * head_dim].reshape(tokens, -1, head_dim)
    expected = apply_rotary(heads.float(), cos, sin).to(dtype)
    value = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    cpu_layers.rotary_embedding_(qkv, q_heads + kv_heads, head_dim, cos, sin)
    assert_close(qkv[:, : (q_heads + kv_heads) * head_dim].reshape(tokens, -1, head_dim), expected)
    assert qkv[:, (q_heads + kv_heads) * head_dim :].equal(value)


# Builds of layers.c beside this CPU's own, each with the CPU flags it needs to run here.
BUILDS = {"portable": ("x86-64", set()), "avx2": ("x86-64-v3", {"avx2"})}


@pytest.fixture(params=["own", *BUILDS])
def layers_build(request, tmp_path_factory):
    """The bodies of the kernels with code of their own for AVX2 builds: this CPU's own build,
    then the x86-64 baseline's portable vectors and the AVX2 build, each in place of the own
    build where this CPU runs it."""
    if request.param == "own":
        yield
        return
    march, needed_flags = BUILDS[request.param]
    functions = ["argmax_rows", "silu_and_mul", "rms_norm"]
    library = kernel_builds.runnable_build(march, needed_flags, ["layers.c"], functions, tmp_path_factory)
    with kernel_builds.in_place_of_own_build(library):
        yield


@pytest.mark.parametrize("dtype", TOLERANCES, ids=IDS)
@pytest.mark.parametrize("width", [1536, 40], ids=["lanes", "ragged"])
def test_silu_and_mul_matches_torch(layers_build, dtype, width):
    torch.manual_seed(2)
    gate_up = (torch.randn(70, 2 * width) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp saturates both ways
    assert_close(cpu_layers.silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_strided_inputs_are_refused():
    x = torch.randn(4, 64)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        cpu_layers.rms_norm(x, None, torch.ones(32), 1e-6)


def test_a_weight_of_another_dtype_is_refused():
    x = torch.randn(2, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        cpu_layers.rms_norm(x, None, torch.ones(32), 1e-6)


CONVERSIONS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float16),
               (torch.float16, torch.float32), (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(("source", "target"), CONVERSIONS, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(3, 5), (64, 3072), (520, 2048)], ids=["odd", "decode", "threaded"])
def test_convert_rounds_exactly_as_torch(source, target, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 100).to(source)
    assert torch.equal(cpu_layers.convert(x, target), x.to(target))


def test_convert_keeps_infinities_and_nans():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.0e38, -0.0, 1e-40])
    converted = cpu_layers.convert(x, torch.bfloat16)
    torch.testing.assert_close(converted, x.to(torch.bfloat16), equal_nan=True, atol=0, rtol=0)
    numbers = ~x.isnan()  # a NaN's sign bit means nothing
    assert torch.equal(converted[numbers].float().signbit(), x[numbers].to(torch.bfloat16).float().signbit())


@pytest.mark.parametrize("shape", [(1, 49152), (64, 1100), (3, 7), (2, 16)], ids=["vocabulary", "threaded", "short", "one_vector"])
def test_argmax_picks_what_torch_max_picks(layers_build, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    x[0, -1] = x[0].max() + 1  # the largest in the tail past the last whole vector
    assert torch.equal(cpu_layers.argmax(x), x.max(dim=-1).indices)


def test_argmax_takes_the_first_of_equal_largest_values(layers_build):
    x = torch.zeros(4, 40)
    x[0, [3, 19, 35]] = 5.0  # in different lanes
    x[1, [20, 36]] = 5.0  # in the same lane of different vectors
    x[2, [21, 22]] = 5.0
    x[3] = -float("inf")  # nothing but -inf: the first
    assert cpu_layers.argmax(x).tolist() == [3, 20, 21, 0]


def test_argmax_picks_the_first_nan_as_torch_max_does(layers_build):
    x = torch.randn(2, 40)
    x[0, [30, 5]] = float("nan")
    x[1, 38] = float("nan")
    assert torch.equal(cpu_layers.argmax(x), x.max(dim=-1).indices)
    assert cpu_layers.argmax(x).tolist() == [5, 38]
