"""The Triton KV-cache kernels equal their references in ``kernels.reference`` bit for bit.

Runs compiled on CUDA when present, else under the Triton interpreter (see tests/conftest.py).
Both kernels only move elements, so the comparison is exact.
"""

import pytest
import torch

from strata.kernels import reference, triton_kv_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16


def random_cache(
    num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """``[2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]`` of random values."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.randn(shape, generator=generator).to(dtype).to(DEVICE)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert reference.float8_as_bytes(actual).equal(reference.float8_as_bytes(expected))


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,dtype",
    [(1, 64, torch.float32), (3, 80, torch.bfloat16), (8, 128, torch.bfloat16), (2, 64, torch.float8_e4m3fn)],
)
def test_write_kv_cache(num_kv_heads, head_dim, dtype):
    num_tokens = 7
    cache = random_cache(4, num_kv_heads, head_dim, dtype, seed=0)
    # Key and value are strided views of one projection output, as the model produces them.
    generator = torch.Generator().manual_seed(1)
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = kv.to(DEVICE).unbind(1)
    # Distinct slots in several blocks, ragged within them; -1 (tokens 1 and 4) writes nothing.
    slot_mapping = torch.tensor([5, -1, 16, 17, -1, 63, 0], dtype=torch.int64, device=DEVICE)

    expected = cache.clone()
    reference.write_kv_cache(key, value, expected, slot_mapping)
    triton_kv_cache.write_kv_cache(key, value, cache, slot_mapping)
    assert_same_bytes(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize(
    "src_blocks,dst_blocks,src_ids,dst_ids",
    [
        (10, 4, [7, 0, 3], [2, 0, 3]),  # GPU cache -> smaller staging buffer
        (4, 10, [1, 3, 0, 2], [9, 4, 5, 0]),  # staging buffer -> GPU cache
    ],
    ids=["to_staging", "from_staging"],
)
def test_copy_blocks(src_blocks, dst_blocks, src_ids, dst_ids, dtype):
    src = random_cache(src_blocks, 2, 80, dtype, seed=0)
    dst = random_cache(dst_blocks, 2, 80, dtype, seed=1)
    src_before = src.clone()
    src_ids, dst_ids = (torch.tensor(ids, device=DEVICE) for ids in (src_ids, dst_ids))

    expected = dst.clone()
    reference.copy_blocks(src, expected, src_ids, dst_ids)
    triton_kv_cache.copy_blocks(src, dst, src_ids, dst_ids)
    assert_same_bytes(dst, expected)
    assert_same_bytes(src, src_before)
