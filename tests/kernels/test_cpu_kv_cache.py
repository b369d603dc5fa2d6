"""The C KV-cache write and block copy (``kernels.cpu_kv_cache``) equal the torch reference, the
written keys once untiled from the C kernels' layout."""

import pytest
import torch

from strata.kernels import cpu_kv_cache, native, reference

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler to build the CPU kernels")


@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32_cache", "bf16_cache", "fp8_cache"]
)
def test_write_matches_reference_on_strided_views_with_skips(cache_dtype):
    torch.manual_seed(3)
    qkv = torch.randn(6, (4 + 2 * 2) * 16).to(torch.bfloat16)
    key, value = (t.view(6, 2, 16) for t in qkv[:, 64:].split(32, dim=1))
    slots = torch.tensor([5, -1, 0, 17, -1, 30])
    caches = [reference.float8_as_bytes(torch.zeros(2, 2, 16, 2, 16, dtype=cache_dtype)) for _ in range(2)]
    cpu_kv_cache.write_kv_cache(key, value, caches[0].view(cache_dtype), slots)
    reference.write_kv_cache(key, value, caches[1].view(cache_dtype), slots)
    assert cpu_kv_cache.untile_keys(caches[0]).equal(caches[1]) and caches[0].count_nonzero() > 0


def test_a_float8_write_rounds_and_saturates_every_value_as_torch_does():
    """Every float8 e4m3 value, the midpoints between neighbours (ties to even) and the floats
    either side of them, subnormals, values past 448, infinities and NaN."""
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[finite.isfinite()].unique()
    midpoints = (finite[1:] + finite[:-1]) / 2
    edges = [midpoints.nextafter(torch.tensor(bound)) for bound in (float("inf"), float("-inf"))]
    extremes = torch.tensor([449.0, 464.0, 465.0, -1e30, float("inf"), float("-inf"), float("nan"), -0.0, 2.0**-10])
    values = torch.cat([finite, midpoints, *edges, extremes, torch.randn(4096) * 40]).float()
    values = values[: values.numel() // 256 * 256].view(-1, 1, 16)
    cache = torch.zeros(2, values.shape[0] // 16, 16, 1, 16, dtype=torch.float8_e4m3fn)
    cpu_kv_cache.write_kv_cache(values, values, cache, torch.arange(values.shape[0]))
    expected = values.to(torch.float8_e4m3fn).view(torch.uint8)
    assert cpu_kv_cache.untile_keys(cache.view(torch.uint8))[0].flatten().equal(expected.flatten())
    assert cache[1].view(torch.uint8).flatten().equal(expected.flatten())


def test_a_prefill_sized_write_split_across_threads_matches_reference():
    torch.manual_seed(5)
    key, value = torch.randn(2, 1000, 3, 64).to(torch.bfloat16)
    slots = torch.randperm(64 * 16)[:1000]
    slots[::7] = -1
    caches = [torch.zeros(2, 64, 16, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    cpu_kv_cache.write_kv_cache(key, value, caches[0], slots)
    reference.write_kv_cache(key, value, caches[1], slots)
    assert cpu_kv_cache.untile_keys(caches[0]).equal(caches[1])


def test_write_refuses_a_slot_outside_the_cache_before_writing_any():
    key = torch.randn(300, 2, 16)
    cache = torch.zeros(2, 20, 16, 2, 16)
    slots = torch.arange(300)
    slots[150] = 320
    with pytest.raises(IndexError, match="outside"):
        cpu_kv_cache.write_kv_cache(key, key, cache, slots)
    assert cache.eq(0).all()


def test_copy_between_caches_of_different_sizes_matches_reference():
    torch.manual_seed(4)
    small = torch.randn(2, 5, 16, 3, 64).to(torch.bfloat16)
    large = [torch.zeros(2, 12, 16, 3, 64, dtype=torch.bfloat16) for _ in range(2)]
    src, dst = torch.tensor([4, 0, 2]), torch.tensor([11, 3, 7])
    cpu_kv_cache.copy_blocks(small, large[0], src, dst)
    reference.copy_blocks(small, large[1], src, dst)
    assert large[0].equal(large[1])
    back = torch.zeros_like(small)
    cpu_kv_cache.copy_blocks(large[0], back, dst, src)
    assert back[:, [4, 0, 2]].equal(small[:, [4, 0, 2]]) and back[:, [1, 3]].eq(0).all()


def test_copy_refuses_a_block_outside_its_cache():
    with pytest.raises(IndexError, match="outside"):
        cpu_kv_cache.copy_blocks(torch.zeros(2, 2, 16, 1, 16), torch.zeros(2, 4, 16, 1, 16), torch.tensor([2]), torch.tensor([0]))
