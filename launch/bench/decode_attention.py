"""One decode step's attention through the C kernel (``kernels/csrc/paged_attention.c``), layer
after layer, each layer with its own paged cache so the reads come from memory as in a real step:

    python -m strata.launch.bench.decode_attention [--seqs 64] [--context 320] [--layers 30]
        [--heads 9] [--kv-heads 3] [--head-dim 64] [--block-size 64] [--dtype bfloat16] [--cache-dtype fp8]
        [--scattered]

The shape defaults to the default model's (9 query heads, 3 KV heads of 64, 30 layers) in the
engine's CPU blocks (64 positions); ``--dtype`` is the queries' and, unless ``--cache-dtype`` names
another (as ``--kv-cache-dtype`` does), the cache's (bfloat16, or float32 as a float32 model keeps
them). Each sequence's blocks are contiguous in the cache, as they are for a prompt prefilled at
once, or with ``--scattered`` spread at random over it, as for the blocks a sequence gains while
it decodes beside others. Prints the best of 7 timings of the whole stack, microseconds per
layer and the cache bytes read per second, with ``lscpu``'s CPU.
"""

import argparse
import time

import torch

from strata.kernels import cpu_attention
from strata.launch.bench.compare_vllm import CpuInfo
from strata.runtime.engine_args import CPU_BLOCK_SIZE
from strata.worker.attention import named_cache_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=320, help="cached positions per sequence")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=CPU_BLOCK_SIZE, help="positions per block")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--cache-dtype", choices=["bfloat16", "float32", "float16", "fp8"], help="default: --dtype")
    parser.add_argument("--scattered", action="store_true", help="each sequence's blocks at random places")
    args = parser.parse_args()
    if not cpu_attention.is_available():
        raise SystemExit("the C kernels are not available on this machine (see kernels.native)")
    dtype = getattr(torch, args.dtype)
    cache_dtype = named_cache_dtype(args.cache_dtype or args.dtype)
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.seqs * blocks_per_seq
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    caches = [torch.randn(shape, generator=generator).to(cache_dtype) for _ in range(args.layers)]
    order = torch.randperm(num_blocks, generator=generator) if args.scattered else torch.arange(num_blocks)
    block_tables = order.to(torch.int32).view(args.seqs, blocks_per_seq).contiguous()
    query = torch.randn(args.seqs, args.heads, args.head_dim, generator=generator).to(dtype)
    query_start_loc = torch.arange(args.seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    scale = args.head_dim**-0.5

    def step() -> None:
        for cache in caches:
            cpu_attention.paged_attention(query, cache, block_tables, query_start_loc, seq_lens, scale)

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    cache_bytes = args.layers * 2 * args.seqs * args.context * args.kv_heads * args.head_dim * cache_dtype.itemsize
    layout = "scattered" if args.scattered else "contiguous"
    print(CpuInfo.read().describe())
    print(
        f"{args.seqs} x {args.context} positions, {args.layers} layers, {args.dtype} queries over a "
        f"{cache_dtype} cache, {layout} blocks of {args.block_size}: "
        f"{best * 1e6 / args.layers:.0f} us per layer, {cache_bytes / best / 1e9:.1f} GB/s of cache read"
    )


if __name__ == "__main__":
    main()
