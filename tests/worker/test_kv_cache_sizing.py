"""The KV cache gets the configured share of the GPU minus weights, activations, graphs and
memory outside torch, with the profile's numbers injected."""

import pytest

from strata.worker.kv_cache_sizing import GIB, DeviceMemory, kv_cache_bytes

H100 = 80 * GIB


def test_the_cache_gets_the_share_left_after_every_other_use() -> None:
    memory = DeviceMemory(
        total=H100, weights=16 * GIB, peak_activations=3 * GIB, cuda_graphs=GIB // 2, non_torch=GIB // 2
    )
    assert kv_cache_bytes(memory, 0.9) == int(0.9 * H100) - 20 * GIB


def test_a_larger_step_leaves_less_for_the_cache() -> None:
    small = DeviceMemory(total=H100, weights=2 * GIB, peak_activations=GIB, cuda_graphs=0, non_torch=0)
    large = DeviceMemory(total=H100, weights=2 * GIB, peak_activations=9 * GIB, cuda_graphs=0, non_torch=0)
    assert kv_cache_bytes(small, 0.9) - kv_cache_bytes(large, 0.9) == 8 * GIB


def test_nothing_left_is_an_error_naming_each_term() -> None:
    memory = DeviceMemory(total=H100, weights=70 * GIB, peak_activations=3 * GIB, cuda_graphs=0, non_torch=GIB)
    with pytest.raises(ValueError, match=r"weights take 70.00 GiB.*activations 3.00 GiB.*--gpu-memory-utilization"):
        kv_cache_bytes(memory, 0.9)


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.5])
def test_utilization_outside_zero_to_one_is_refused(utilization: float) -> None:
    memory = DeviceMemory(total=H100, weights=0, peak_activations=0, cuda_graphs=0, non_torch=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        kv_cache_bytes(memory, utilization)
