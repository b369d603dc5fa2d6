"""The CPU KV cache's memory: zeros that cost nothing until written, and a size check up front."""

import psutil
import pytest
import torch

from strata.worker.cpu_memory import check_kv_cache_fits, zeroed_cpu_tensor


def test_zeroed_tensor_reads_as_zeros_and_takes_writes():
    cache = zeroed_cpu_tensor((2, 5, 16, 3, 8), torch.bfloat16)
    assert cache.shape == (2, 5, 16, 3, 8) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert torch.count_nonzero(cache) == 0
    cache[1, 4] = 2.5
    assert cache.sum().item() == 2.5 * 16 * 3 * 8


def test_zeroed_tensor_costs_no_memory_until_written():
    rss = psutil.Process().memory_info().rss
    cache = zeroed_cpu_tensor((1 << 30,), torch.float32)  # 4 GiB of address space
    assert psutil.Process().memory_info().rss - rss < 64 << 20
    cache[: 1 << 20] = 1.0
    assert cache[: 1 << 20].sum().item() == 1 << 20


def test_an_empty_shape_gives_an_empty_tensor():
    assert zeroed_cpu_tensor((0, 16), torch.float32).shape == (0, 16)


def test_a_kv_cache_larger_than_the_available_memory_is_refused_up_front():
    too_big = psutil.virtual_memory().available + (1 << 30)
    with pytest.raises(ValueError, match="lower --kv-cache-memory"):
        check_kv_cache_fits(too_big)
    check_kv_cache_fits(1 << 20)
