"""The CPU KV cache's memory: zeros that cost nothing until written or backed at once when
committed, and a size check up front; the weights' memory: moved onto huge pages in place."""

import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch import nn

from strata.kernels import gguf_linear
from strata.worker.cpu_memory import check_kv_cache_fits, move_to_huge_pages, move_weights_to_huge_pages, zeroed_cpu_tensor
from strata.worker.tp_layers import QuantizedWeight

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
KERNEL_VERSION = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])


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


@pytest.mark.skipif(KERNEL_VERSION < (5, 14), reason="MADV_POPULATE_WRITE is Linux 5.14's")
def test_a_committed_tensor_is_backed_at_once_and_reads_as_zeros():
    rss = psutil.Process().memory_info().rss
    cache = zeroed_cpu_tensor((16 << 20,), torch.float32, commit=True)  # 64 MB
    assert psutil.Process().memory_info().rss - rss >= 60 << 20
    assert torch.count_nonzero(cache) == 0


def test_an_empty_shape_gives_an_empty_tensor():
    assert zeroed_cpu_tensor((0, 16), torch.float32).shape == (0, 16)


def test_a_kv_cache_larger_than_the_available_memory_is_refused_up_front():
    too_big = psutil.virtual_memory().available + (1 << 30)
    with pytest.raises(ValueError, match="lower --kv-cache-memory"):
        check_kv_cache_fits(too_big)
    check_kv_cache_fits(1 << 20)


def test_moved_tensors_keep_their_values_and_every_holder_sees_the_new_memory():
    module = nn.Linear(300, 70)
    module.register_buffer("scale", torch.arange(5.0))
    held_elsewhere = module.weight
    weight, bias, scale = module.weight.clone(), module.bias.clone(), module.scale.clone()
    old_address = module.weight.data_ptr()
    move_to_huge_pages([module.weight, module.bias, module.scale, held_elsewhere])
    assert module.weight.data_ptr() != old_address and held_elsewhere.data_ptr() == module.weight.data_ptr()
    assert torch.equal(module.weight, weight) and torch.equal(module.bias, bias) and torch.equal(module.scale, scale)
    assert module.weight.data_ptr() % 64 == 0 and module.bias.data_ptr() % 64 == 0 and module.scale.data_ptr() % 64 == 0


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(), reason="the kernel gives no transparent huge pages"
)
def test_moved_tensors_lie_on_huge_pages():
    tensor = torch.ones(4 << 20)  # 16 MB
    move_to_huge_pages([tensor])
    assert huge_page_kb_at(tensor.data_ptr()) >= 2048


MOVE_PEAK_PROGRAM = """
import resource, torch
from strata.worker.cpu_memory import keep_freed_memory, move_to_huge_pages
keep_freed_memory()
tensors = [torch.ones(1 << 18) for _ in range(512)]  # 512 MB of heap, 1 MB at a time
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
move_to_huge_pages(tensors)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


def test_a_move_holds_two_copies_of_a_bounded_part_of_the_weights_at_once():
    # 512 MB moved: keeping every freed megabyte until the end would peak 512 MB higher.
    grew_mib = int(subprocess.run([sys.executable, "-c", MOVE_PEAK_PROGRAM], capture_output=True, text=True, check=True).stdout)
    assert grew_mib < 256


def huge_page_kb_at(address: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_block_matrix_moved_with_its_model_multiplies_from_the_new_memory():
    rows, cols = 8, 64  # Q8_0: 2 blocks of 34 bytes (a float16 scale, 32 int8 values) per row
    blocks = np.random.default_rng(0).integers(0, 256, size=(rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    part = gguf_linear.QuantizedPart(torch.from_numpy(blocks.reshape(rows, -1)), gguf_linear.TYPES["Q8_0"])
    module = nn.Module()
    module.quantized = QuantizedWeight(gguf_linear.QuantizedMatrix([part], cols))
    x = torch.randn(3, cols)
    before = gguf_linear.linear(x, module.quantized.matrix)
    move_weights_to_huge_pages(module)
    assert module.quantized.matrix.struct.data[0] == part.data.data_ptr()
    assert torch.equal(gguf_linear.linear(x, module.quantized.matrix), before)
