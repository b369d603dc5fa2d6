#!/usr/bin/env python3
"""bfloat16 against float32 ``F.linear`` on this CPU, for the default model's decoder shapes.

    python benchmarks/linear_dtype_ab.py [--rows 1,16,64,512] [--reps 15]

The two dtypes are timed alternately in one process (one call of each per round, median over
rounds), so that a busy machine slows both alike and their ratio survives. ``--dtype auto``
should pick whichever is faster where it matters: decode steps run 16 to 256 rows.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (name, in_features, out_features) of SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64, MLP 1536.
SHAPES = [("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072), ("down_proj", 1536, 576),
          ("lm_head", 576, 49152)]
DTYPES = (torch.float32, torch.bfloat16)


def seconds_per_call(x: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        F.linear(x, weight)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,512")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability {torch.backends.cpu.get_cpu_capability()}")
    print("| shape | rows | float32 us | bfloat16 us | bf16 / fp32 time |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name, fan_in, fan_out in SHAPES:
            for rows in map(int, args.rows.split(",")):
                operands = {d: (torch.randn(rows, fan_in, dtype=d), torch.randn(fan_out, fan_in, dtype=d)) for d in DTYPES}
                calls = max(1, int(2e8 // (rows * fan_in * fan_out)))  # about 0.4 GFLOP a sample
                for dtype in DTYPES:
                    seconds_per_call(*operands[dtype], calls)  # warm-up: oneDNN primitive creation
                samples: dict[torch.dtype, list[float]] = {d: [] for d in DTYPES}
                for _ in range(args.reps):
                    for dtype in DTYPES:
                        samples[dtype].append(seconds_per_call(*operands[dtype], calls))
                fp32, bf16 = (statistics.median(samples[d]) * 1e6 for d in DTYPES)
                print(f"| {name} {fan_in}->{fan_out} | {rows} | {fp32:.1f} | {bf16:.1f} | {bf16 / fp32:.2f} |", flush=True)


if __name__ == "__main__":
    main()
