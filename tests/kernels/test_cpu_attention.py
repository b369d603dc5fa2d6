"""The C paged attention (``kernels.cpu_attention``) equals ``kernels.reference.paged_attention``.

Tolerances (``atol = rtol``, outputs of magnitude ~1): fp32 ``1e-5``, only the summation order
and the exponential's last bits differ; fp16 ``2e-3`` and bf16 ``1.6e-2``, about two ulps of
the output dtype: both kernels compute in float32 and round the output once, so they differ by
at most the ulp a float32-level difference can tip over.
"""

import pytest
import torch

import kernel_builds
from paged_batches import BATCHES, LAYOUTS, NUM_KV_HEADS, forward_beside_torch_backend, make_batch
from strata.kernels import cpu_attention, reference
from strata.kernels.cpu_kv_cache import tile_keys
from strata.worker.attention import CpuAttentionBackend, get_attention_backend

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Contexts longer than one 16-position tile and not a multiple of it, beside decodes.
LONG_BATCH = ([1, 40, 1, 3, 24], [300, 40, 17, 129, 100])
# Chunks at and past CpuAttentionBackend.LONG_CHUNK_TOKENS (64, left to torch's fused attention),
# a whole prompt and one over cached context, beside a shorter chunk and decodes.
BATCH_WITH_LONG_CHUNKS = ([1, 64, 1, 40, 100], [300, 64, 17, 129, 230])
# One position, shorter and longer than a 16-position tile, longer than every context (= none).
SLIDING_WINDOWS = [1, 5, 20, 1000]

pytestmark = pytest.mark.skipif(not cpu_attention.is_available(), reason="no C compiler to build the CPU kernels")


def run_kernel(b, sliding_window: int | None = None) -> torch.Tensor:
    meta = b.meta
    return cpu_attention.paged_attention(
        b.query, tile_keys(b.kv_cache), meta.block_tables, meta.query_start_loc, meta.seq_lens, b.scale, sliding_window=sliding_window
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", TOLERANCES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("group,head_dim,block_size", LAYOUTS)
@pytest.mark.parametrize("batch", [*BATCHES.values(), LONG_BATCH], ids=[*BATCHES, "long"])
def test_matches_reference(batch, group, head_dim, block_size, dtype):
    b = make_batch(*batch, group, head_dim, block_size, dtype)
    assert_close(run_kernel(b), b.reference())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", SLIDING_WINDOWS)
@pytest.mark.parametrize("batch", [BATCHES["mixed"], BATCHES["chunk_with_context"], LONG_BATCH], ids=["mixed", "chunk", "long"])
def test_sliding_window_matches_reference(batch, sliding_window, dtype):
    group, head_dim, block_size = LAYOUTS[1]  # GQA, 32-token blocks: windows end inside blocks and tiles
    b = make_batch(*batch, group, head_dim, block_size, dtype)
    assert_close(run_kernel(b, sliding_window), b.reference(sliding_window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scores_that_rise_far_above_the_running_maximum_match_reference(dtype):
    """Queries 300 times larger spread the scores so that a later tile's often exceed the running
    maximum by more than the kernel's rescale margin, and by more than float32's exponent range
    (it must move the maximum and rescale the sums), while others stay within the margin
    (exponentiated against the old maximum). Scores of hundreds carry that much more of the two
    kernels' different summation orders into the exponentials: float32's tolerance is 1e-3 here
    (a sum not rescaled is off by e^8 or overflows)."""
    b = make_batch(*LONG_BATCH, 3, 64, 16, dtype)
    b.query = (b.query.float() * 300).to(dtype)
    tol = max(TOLERANCES[dtype], 1e-3)
    torch.testing.assert_close(run_kernel(b), b.reference(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_decode_rows_walked_whole_equal_them_split_by_segment(sliding_window, dtype):
    """Eight decode rows are enough for 2 threads to walk each row's context whole, and too few
    for 8 threads, which split each row into a run of 64-position segments per thread (here
    mostly one segment each) and join the segments' softmaxes after; the first row alone, on 2
    threads, splits into two runs of several segments. The results match the reference and each
    other bit for bit (a verification of draft tokens relies on it). In bfloat16 on a CPU with
    AMX the scores run on tiles."""
    b = make_batch([1] * 8, [300, 17, 129, 64, 1, 40, 250, 33], 3, 64, 16, dtype)
    meta = b.meta
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = run_kernel(b, sliding_window)
        first_alone = cpu_attention.paged_attention(
            b.query[:1], tile_keys(b.kv_cache), meta.block_tables[:1], meta.query_start_loc[:2], meta.seq_lens[:1], b.scale,
            sliding_window=sliding_window,
        )
        torch.set_num_threads(8)
        split = run_kernel(b, sliding_window)
    finally:
        torch.set_num_threads(threads)
    assert_close(whole, b.reference(sliding_window=sliding_window))
    assert torch.equal(whole, split)
    assert torch.equal(whole[:1], first_alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (5, 64), (6, 128)])
def test_a_decode_row_equals_its_position_among_several_new_tokens(group, head_dim, sliding_window, dtype):
    """Four new tokens over 300 positions (a verification of three draft tokens) attend as one
    item per KV head; each token alone as a decode row at its position, split by segment, gets
    the same result bit for bit: every walk joins the same segments in the same order, and on
    AMX (bfloat16) a query vector's scores do not depend on the vectors sharing its tile, nor a
    decode row's values on how many of a KV head's query rows share their sums' registers (four
    at a time at head_dim 64, where a group of 5 leaves one; two at a time at 128)."""
    assert_decode_rows_equal_a_verification(group, head_dim, sliding_window, dtype)


def assert_decode_rows_equal_a_verification(group: int, head_dim: int, sliding_window: int | None, dtype) -> None:
    b = make_batch([4], [300], group, head_dim, 16, dtype)
    together = run_kernel(b, sliding_window)
    one_row = torch.tensor([0, 1], dtype=torch.int32)
    for token in range(4):
        alone = cpu_attention.paged_attention(
            b.query[token : token + 1], tile_keys(b.kv_cache), b.meta.block_tables, one_row,
            torch.tensor([297 + token], dtype=torch.int32), b.scale, sliding_window=sliding_window,
        )
        assert torch.equal(alone[0], together[token])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [12, 16])
def test_decode_rows_with_more_query_heads_than_a_score_tile_holds_match_reference(group, dtype):
    """24 or 32 query heads over 2 KV heads: on AMX a decode row's scores take a tile per KV head
    (16 columns at most), and a verification's rows of one KV head several tiles."""
    b = make_batch(*LONG_BATCH, group, 64, 16, dtype)
    assert_close(run_kernel(b), b.reference())


def test_sliding_window_skips_blocks_behind_every_window():
    """Blocks no query's window reaches are never read: filling them with NaN changes nothing."""
    b = make_batch([1, 9], [300, 129], 2, 64, 16, torch.float32)
    expected = b.reference(sliding_window=40)
    for seq, (q_len, context) in enumerate([(1, 300), (9, 129)]):
        first_seen = context - q_len - 40 + 1
        behind = b.meta.block_tables[seq, : first_seen // 16].long()
        b.kv_cache[:, behind] = float("nan")
    assert_close(run_kernel(b, sliding_window=40), expected)


def test_strided_query_view():
    b = make_batch(*LONG_BATCH, 2, 64, 16, torch.bfloat16)
    wide = torch.randn(b.query.shape[0], b.query.shape[1] + 3, 64).to(torch.bfloat16)
    wide[:, 1 : 1 + b.query.shape[1]] = b.query
    expected = b.reference()
    b.query = wide[:, 1 : 1 + b.query.shape[1]]
    assert not b.query.is_contiguous()
    assert_close(run_kernel(b), expected)


@pytest.mark.parametrize(
    "head_dim,block_size,group", [(72, 16, 1), (64, 8, 1), (64, 16, 32)], ids=["head_dim", "block_size", "group"]
)
def test_unsupported_shapes_are_refused_and_the_backend_falls_back(head_dim, block_size, group):
    b = make_batch(*BATCHES["mixed"], group, head_dim, block_size, torch.float32)
    assert not cpu_attention.supports(b.query.shape[1], NUM_KV_HEADS, head_dim, block_size)
    meta = b.meta
    with pytest.raises(ValueError, match="not supported"):
        cpu_attention.paged_attention(b.query, b.kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, b.scale)
    new = torch.randn(b.query.shape[0], NUM_KV_HEADS, head_dim)
    out = CpuAttentionBackend().forward(b.query, new, new, b.kv_cache, b.meta, b.scale)
    assert_close(out, b.reference())


def test_sequences_with_long_chunks_are_left_and_the_rest_computed():
    b = make_batch(*BATCH_WITH_LONG_CHUNKS, 3, 64, 16, torch.bfloat16)
    meta = b.meta
    out = cpu_attention.paged_attention(
        b.query, tile_keys(b.kv_cache), meta.block_tables, meta.query_start_loc, meta.seq_lens, b.scale, long_chunk_tokens=64
    )
    starts = meta.query_start_loc.tolist()
    computed = [row for s in range(len(starts) - 1) if starts[s + 1] - starts[s] < 64 for row in range(starts[s], starts[s + 1])]
    assert_close(out[computed], b.reference()[computed])


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("batch", [LONG_BATCH, BATCH_WITH_LONG_CHUNKS], ids=["short-chunks", "long-chunks"])
def test_cpu_backend_matches_torch_backend(batch, sliding_window):
    """Whole forward: strided q/k/v views of one projection, K/V written, then attention."""
    group, head_dim = 3, 64
    b = make_batch(*batch, group, head_dim, 16, torch.bfloat16)
    caches, outs = forward_beside_torch_backend(CpuAttentionBackend(), b, sliding_window, keys_tiled=True)
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)
    assert_close(outs[0], outs[1])


def test_a_long_chunk_the_c_kernel_declines_is_attended_over_its_blocks_untiled(monkeypatch):
    """Where ``chunk_attention`` takes no chunk (a work buffer it could not allocate), the backend
    hands the reference each long chunk's blocks with their keys back in the reference's layout."""
    monkeypatch.setattr(cpu_attention, "chunk_attention", lambda *args, **kwargs: False)
    b = make_batch(*BATCH_WITH_LONG_CHUNKS, 3, 64, 16, torch.bfloat16)
    caches, outs = forward_beside_torch_backend(CpuAttentionBackend(), b, keys_tiled=True)
    assert_close(outs[0], outs[1])


@pytest.mark.parametrize(
    "cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=["bf16-cache", "fp16-cache", "fp8-cache"]
)
@pytest.mark.parametrize("batch", [LONG_BATCH, BATCH_WITH_LONG_CHUNKS], ids=["short-chunks", "long-chunks"])
def test_a_float32_model_over_a_narrower_cache_matches_torch_backend(batch, cache_dtype):
    """``--kv-cache-dtype bfloat16``, ``float16`` or ``fp8`` under a float32 model: keys and values are rounded
    once, as they are written; attention then widens them exactly, so it agrees to float32's
    tolerance."""
    b = make_batch(*batch, 3, 64, 16, torch.float32)
    b.kv_cache = b.kv_cache.to(cache_dtype)
    caches, outs = forward_beside_torch_backend(CpuAttentionBackend(), b, keys_tiled=True)
    assert reference.float8_as_bytes(caches[0]).equal(reference.float8_as_bytes(caches[1]))
    assert outs[0].dtype == torch.float32
    assert_close(outs[0], outs[1])


def assert_every_float8_code_reads_back_exactly() -> None:
    """Over a context of one position a query's output is that position's value row: each of
    the 256 codes (subnormals, NaN) must widen to torch's float32 for it."""
    b = make_batch([1] * 4, [1] * 4, 1, 32, 16, torch.float32)
    b.kv_cache = b.kv_cache.to(torch.float8_e4m3fn)
    codes = torch.arange(256, dtype=torch.uint8).view(4, NUM_KV_HEADS, 32)
    first_blocks = b.meta.block_tables[:, 0].long()
    b.kv_cache.view(torch.uint8)[1, first_blocks, 0] = codes
    expected = codes.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(run_kernel(b), expected, atol=0, rtol=0, equal_nan=True)


def test_every_float8_code_reads_back_exactly():
    assert_every_float8_code_reads_back_exactly()


def test_cpu_is_the_default_backend_on_cpu():
    assert get_attention_backend(None, torch.device("cpu")).name == "cpu"


def swapped_in(march: str, needed_flags: set[str], tmp_path_factory):
    library = kernel_builds.runnable_build(
        march, needed_flags, ["paged_attention.c"], ["paged_attention"], tmp_path_factory
    )
    with kernel_builds.in_place_of_own_build(library):
        yield


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The kernel built for AVX2 (``x86-64-v3``), whose vectors are pairs of registers, in place
    of this CPU's own build; on an AVX2 machine it is the same code as the native build."""
    yield from swapped_in("x86-64-v3", {"avx2"}, tmp_path_factory)


@pytest.fixture(scope="module")
def portable_build(tmp_path_factory):
    """The kernel built for the x86-64 baseline: no AVX, the portable vector code (what other
    architectures build) in place of this CPU's own build."""
    yield from swapped_in("x86-64", set(), tmp_path_factory)


@pytest.fixture(scope="module")
def avx512_build(tmp_path_factory):
    """The kernel built for AVX-512 without AVX512-BF16 or AMX (``icelake-server``): on a CPU with
    AMX, the bfloat16 scores that CPUs without it compute in vectors."""
    yield from swapped_in("icelake-server", {"avx512f", "avx512bw", "avx512vl"}, tmp_path_factory)


@pytest.fixture(scope="module")
def emulated_amx_build(tmp_path_factory):
    """The kernel with its AMX bodies, the tiles emulated in C, in place of this CPU's own build:
    on a CPU without AMX, what bfloat16 decode rows and verifications compute on one with it."""
    library = kernel_builds.emulated_amx_build(["paged_attention.c"], ["paged_attention"], tmp_path_factory)
    with kernel_builds.in_place_of_own_build(library):
        yield


@pytest.mark.parametrize("batch", [*BATCHES.values(), LONG_BATCH], ids=[*BATCHES, "long"])
def test_the_emulated_amx_build_matches_reference_in_bfloat16(emulated_amx_build, batch):
    b = make_batch(*batch, 3, 64, 16, torch.bfloat16)
    assert_close(run_kernel(b), b.reference())


@pytest.mark.parametrize("group", [3, 16])  # 16 query heads of a KV head fill a score tile's rows
def test_the_emulated_amx_build_matches_reference_at_head_dim_128(emulated_amx_build, group):
    b = make_batch(*LONG_BATCH, group, 128, 16, torch.bfloat16)
    assert_close(run_kernel(b), b.reference())


@pytest.mark.parametrize("group,head_dim", [(3, 64), (5, 64), (6, 128)])
def test_the_emulated_amx_build_gives_a_decode_row_the_bits_of_a_verification(emulated_amx_build, group, head_dim):
    assert_decode_rows_equal_a_verification(group, head_dim, None, torch.bfloat16)


@pytest.mark.parametrize("batch", [BATCHES["mixed"], LONG_BATCH], ids=["mixed", "long"])
def test_the_avx512_build_without_amx_matches_reference_in_bfloat16(avx512_build, batch):
    b = make_batch(*batch, 3, 64, 16, torch.bfloat16)
    assert_close(run_kernel(b), b.reference())


@pytest.mark.parametrize("dtype", TOLERANCES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("batch", [BATCHES["mixed"], LONG_BATCH], ids=["mixed", "long"])
def test_the_avx2_build_matches_reference(avx2_build, batch, dtype):
    b = make_batch(*batch, 3, 64, 16, dtype)
    assert_close(run_kernel(b), b.reference())


@pytest.mark.parametrize(
    "cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=["bf16", "fp16", "fp8"]
)
def test_the_avx2_build_widens_a_narrower_cache_under_a_float32_model(avx2_build, cache_dtype):
    b = make_batch(*LONG_BATCH, 3, 64, 16, torch.float32)
    b.kv_cache = b.kv_cache.to(cache_dtype)
    assert_close(run_kernel(b), b.reference())


@pytest.mark.parametrize("group,head_dim", [(3, 64), (6, 128)])
def test_the_avx2_build_gives_a_decode_row_the_bits_of_a_verification(avx2_build, group, head_dim):
    """The AVX2 build's decode walk widens its tiles and scores them in its own registers;
    attend_tile scores with the same function, so the bits still agree."""
    assert_decode_rows_equal_a_verification(group, head_dim, None, torch.float32)


def test_the_avx2_build_reads_every_float8_code_exactly(avx2_build):
    assert_every_float8_code_reads_back_exactly()


def test_the_portable_build_reads_every_float8_code_exactly(portable_build):
    assert_every_float8_code_reads_back_exactly()
