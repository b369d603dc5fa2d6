"""The chunk attention (``kernels.cpu_attention.chunk_attention``) equals float64 attention on
the same values within what its roundings allow, in each build this CPU runs: the kernels' own
(for bfloat16, AMX tiles where the CPU has AMX, ``vdpbf16ps`` where it has AVX512-BF16, float32
arithmetic otherwise), an AVX2 build and a portable one (float32 arithmetic whatever the dtypes;
the portable build runs the 16-lane code AVX-512 builds run, in narrower registers) and, on a CPU
with AVX512-BF16, a build of it without AMX (``vdpbf16ps``) and one whose AMX tiles are emulated
in C (``kernel_builds.emulated_amx_build``).

In bfloat16 the scores are exact products summed in float32; the bfloat16 kernel rounds the
probabilities to bfloat16 (relative error at most 2^-9 each, so the weighted sum of values moves by
at most 2^-9 of the largest value magnitude), and the output is rounded to bfloat16 once (2^-9 of
its magnitude): the bound doubles both. In float32 only float32 sums round.
"""

import pytest
import torch

import kernel_builds
from strata.kernels import cpu_attention, cpu_features, native
from strata.kernels.cpu_kv_cache import tile_keys

BLOCK_SIZE = 16
AVX2 = "x86-64-v3"
PORTABLE = "x86-64"
AVX512_BF16 = "cooperlake"  # AVX512-BF16 without AMX
NEEDED_FLAGS = {AVX2: {"avx2"}, PORTABLE: set(), AVX512_BF16: {"avx512_bf16"}}
EMULATED_AMX = "emulated AMX"
BF16_BODIES = {AVX2: 0, PORTABLE: 0, AVX512_BF16: 1, EMULATED_AMX: 2}  # chunk_attention_bf16_body()


@pytest.fixture(params=["native", AVX2, PORTABLE, AVX512_BF16, EMULATED_AMX], scope="module")
def build(request, tmp_path_factory) -> None:
    """Each build this CPU runs: the kernels' own, then an AVX2 one of the chunk kernels, a
    portable one, an AVX512-BF16 one without AMX and one with AMX tiles emulated in C."""
    if native.load_library() is None:
        pytest.skip("no C kernels on this machine")
    if request.param == "native":
        yield
        return
    sources = ["chunk_attention.c", "chunk_attention_avx512bf16.c"]
    functions = ["chunk_attention", "chunk_attention_bf16", "chunk_attention_bf16_body"]
    if request.param == EMULATED_AMX:
        library = kernel_builds.emulated_amx_build(sources, functions, tmp_path_factory)
    else:
        library = kernel_builds.runnable_build(
            request.param, NEEDED_FLAGS[request.param], sources, functions, tmp_path_factory
        )
    assert library.chunk_attention_bf16_body() == BF16_BODIES[request.param]
    with kernel_builds.in_place_of_own_build(library):
        yield


def paged_chunk(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16, seed=0):
    """A cache holding one sequence's ``context`` positions in shuffled blocks, and ``rows`` new
    tokens' queries as a strided view of a wider projection."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-context // BLOCK_SIZE)
    cache = torch.randn(2, num_blocks + 5, BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(dtype)
    blocks = torch.randperm(num_blocks + 5, generator=generator)[:num_blocks].int()
    projection = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    return cache, blocks, projection[:, :heads]


def expected_attention(cache, blocks, query, context, scale, sliding_window=None) -> torch.Tensor:
    """float64 attention of the query rows (the last of ``context`` positions) over the cache."""
    rows, heads, _ = query.shape
    keys, values = (cache[i][blocks.long()].flatten(0, 1)[:context].double() for i in (0, 1))
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    key_position = torch.arange(context)[None, :]
    query_position = torch.arange(context - rows, context)[:, None]
    seen = key_position <= query_position
    if sliding_window is not None:
        seen &= key_position > query_position - sliding_window
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def assert_within_roundings(out: torch.Tensor, expected: torch.Tensor, values: torch.Tensor) -> None:
    rounding = 2**-8 if out.dtype == torch.bfloat16 else 1e-5
    bound = rounding * expected.abs() + rounding * values.abs().max().double() + 1e-6
    excess = (out.double() - expected).abs() - bound
    assert (excess <= 0).all(), f"largest excess over the bound: {excess.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize(
    "rows, context, heads, kv_heads, head_dim, sliding_window",
    [
        (130, 130, 9, 3, 64, None),  # a whole prompt, not a multiple of the 64-position tile
        (100, 300, 9, 3, 64, None),  # a chunk after cached context
        (77, 500, 9, 3, 64, 40),  # a sliding window shorter than the chunk
        (70, 200, 8, 1, 128, None),  # head_dim 128, eight query heads on one KV head
        (65, 65, 4, 4, 64, None),  # no grouping; a last item of fewer query vectors
        (40, 90, 4, 2, 96, None),  # a head size without a body of its own
        (50, 600, 8, 2, 256, 300),  # head_dim 256 under a window
    ],
    ids=["whole-prompt", "after-context", "window", "head-dim-128", "no-groups", "head-dim-96", "head-dim-256"],
)
def test_chunk_attention_equals_float64_attention_within_its_roundings(
    build, dtype, rows, context, heads, kv_heads, head_dim, sliding_window
):
    cache, blocks, query = paged_chunk(rows, context, heads, kv_heads, head_dim, dtype)
    out = torch.empty(rows, heads, head_dim, dtype=dtype)
    assert cpu_attention.chunk_attention(query, tile_keys(cache), blocks, context, 0.125, out, sliding_window)
    assert_within_roundings(out, expected_attention(cache, blocks, query, context, 0.125, sliding_window), cache[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_scores_rising_past_the_rescale_margin_tile_after_tile_are_attended_within_its_roundings(build, dtype):
    # Keys along the queries' direction, longer with position: a tile's scores exceed the
    # previous tile's by about 13, so every tile moves each row's reference maximum up and
    # rescales what the row has summed so far.
    rows, context = 96, 400
    cache, blocks, query = paged_chunk(rows, context, 9, 3, 64, dtype)
    positions = torch.arange(context, dtype=torch.float32)
    ramp = (positions / 40)[:, None, None] + 0.1 * torch.randn(context, 3, 64, generator=torch.Generator().manual_seed(1))
    for p in range(context):
        cache[0, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = ramp[p].to(dtype)
    query = (1 + 0.1 * torch.randn(rows, 9, 64, generator=torch.Generator().manual_seed(2))).to(dtype)
    out = torch.empty(rows, 9, 64, dtype=dtype)
    assert cpu_attention.chunk_attention(query, tile_keys(cache), blocks, context, 0.125, out)
    assert_within_roundings(out, expected_attention(cache, blocks, query, context, 0.125), cache[1])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bfloat16", "float8"])
def test_a_float32_query_over_a_narrower_cache_is_attended_in_float32(build, cache_dtype):
    cache, blocks, query = paged_chunk(80, 200, 6, 2, 64, torch.float32)
    cache = cache.to(cache_dtype)
    out = torch.empty(80, 6, 64)
    assert cpu_attention.chunk_attention(query, tile_keys(cache), blocks, 200, 0.125, out)
    assert_within_roundings(out, expected_attention(cache, blocks, query, 200, 0.125), cache[1].float())


def test_every_float8_code_reads_back_exactly(build):
    """The chunk's first position sees only itself, so its output is its value row: there the
    two KV heads' rows hold all 256 codes (subnormals, NaN), each to widen to torch's float32."""
    cache, blocks, query = paged_chunk(64, 64, 2, 2, 128, torch.float32)
    cache = cache.to(torch.float8_e4m3fn)
    codes = torch.arange(256, dtype=torch.uint8).view(2, 128)
    cache.view(torch.uint8)[1, blocks[0].long(), 0] = codes
    out = torch.empty(64, 2, 128)
    assert cpu_attention.chunk_attention(query, tile_keys(cache), blocks, 64, 0.125, out)
    torch.testing.assert_close(out[0], codes.view(torch.float8_e4m3fn).float(), atol=0, rtol=0, equal_nan=True)


def test_positions_outside_the_context_are_never_read(build):
    cache, blocks, query = paged_chunk(64, 100, 6, 2, 64)
    expected = expected_attention(cache, blocks, query, 100, 0.125)
    tail = cache[:, blocks[-1].long()].clone()
    tail[100 % BLOCK_SIZE :] = float("nan")  # the last block's slots past the context
    cache[:, blocks[-1].long()] = tail
    out = torch.empty(64, 6, 64, dtype=torch.bfloat16)
    assert cpu_attention.chunk_attention(query, tile_keys(cache), blocks, 100, 0.125, out)
    assert_within_roundings(out, expected, cache[1][blocks.long()].flatten(0, 1)[:100])


@pytest.mark.parametrize("what", ["output-dtype", "head-dim-72"])
def test_chunks_the_kernel_does_not_take_are_left_untouched(build, what):
    head_dim = 72 if what == "head-dim-72" else 64
    cache, blocks, query = paged_chunk(64, 64, 4, 2, head_dim)
    out = torch.zeros(64, 4, head_dim, dtype=torch.float32 if what == "output-dtype" else torch.bfloat16)
    assert not cpu_attention.chunk_attention(query, tile_keys(cache), blocks, 64, 0.125, out)
    assert out.eq(0).all()


def test_the_logged_body_for_long_chunks_follows_the_build_and_the_cpus_flags(build, request) -> None:
    flags, built_for = cpu_features.cpu_flags(), request.node.callspec.params["build"]
    expected = (
        "float32 arithmetic" if built_for in (AVX2, PORTABLE)
        else "AVX512-BF16 dot products" if built_for == AVX512_BF16
        else "AMX tiles" if built_for == EMULATED_AMX or {"amx_tile", "amx_bf16"} <= flags
        else "AVX512-BF16 dot products" if "avx512_bf16" in flags
        else "float32 arithmetic"
    )
    assert cpu_attention.chunk_body(torch.bfloat16, torch.bfloat16) == expected
    assert cpu_attention.chunk_body(torch.bfloat16, torch.float8_e4m3fn) == "float32 arithmetic"
