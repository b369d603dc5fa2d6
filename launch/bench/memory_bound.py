"""The single-stream decode speed this machine's memory allows the default model: the bytes of
weights one decode step reads, on the GGUF blocks and dequantized to bfloat16, against the read
bandwidth measured here (the fastest of a few sums over a 1 GiB buffer on huge pages, as the engine
holds its weights, on torch's threads).

    python -m strata.launch.bench.memory_bound [--threads N]

A decode step reads every linear's weights and, with the head tied to the embedding, the whole
embedding once; the norms are a rounding error. Measured tokens/s over the bound printed here is
how close decode comes to the memory (``compare_vllm --workloads single`` measures the first).
"""

import argparse

import torch

from strata.launch.bench.step_profile import read_bandwidth
from strata.worker.attention import get_attention_backend
from strata.worker.model_loader import gguf_file, load_model, quantized_weights_file, resolve_model_path, weight_bytes
from strata.worker.parallel_state import TensorParallel

BUFFER_BYTES = 1 << 30  # far larger than the caches


def decode_bytes(quantization: str) -> int:
    """The bytes of weights the default model holds (all read by a decode step) on the CPU."""
    gguf = gguf_file(None)
    blocks_from = quantized_weights_file(quantization, str(gguf), "cpu")
    backend = get_attention_backend("cpu", torch.device("cpu"))
    model = load_model(resolve_model_path(None), torch.bfloat16, TensorParallel(0, 1), backend, "cpu", blocks_from=blocks_from)
    return weight_bytes(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(BUFFER_BYTES)
    print(f"read bandwidth, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s")
    for label, quantization in (("GGUF blocks", "gguf"), ("bfloat16", "none")):
        step = decode_bytes(quantization)
        print(f"{label}: {step / 1e6:.1f} MB per decode step -> at most {bandwidth / step:.1f} tokens/s")


if __name__ == "__main__":
    main()
