"""LoRA adapters' cost: a batch spread over adapters against the same batch on the base model,
and the time swapping an adapter from CPU memory into a slot adds to a request's first token.

    python -m strata.launch.bench.lora [--model M] [--num-prompts 32] [--num-adapters 4] [--rank 16]

The adapters are random PEFT directories of rank ``--rank`` targeting all seven linears of every
layer, written to a temporary directory for the model at hand (nothing is downloaded).

- Throughput: ``strata bench throughput``'s prompts (``--input-len-min..max`` tokens, then
  ``--output-len`` greedy tokens ignoring EOS), run on the base model and then with the prompts
  spread round-robin over the adapters, in one engine of ``--num-adapters`` slots (each adapter
  is put in its slot by a warm-up first), alternately ``--repeats`` times; the best of each.
- Swap: an engine of one slot and a CPU cache for every adapter. A one-token request of an
  adapter already in the slot, then one of an adapter in CPU memory only (it swaps in), each on
  a fresh prompt of ``--swap-prompt-len`` tokens, ``--repeats`` times; the medians' difference is
  what the swap adds to the first token.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.bench.throughput import CORPUS, Workload, cyclic_slice, synthetic_prompts
from strata.launch.llm import LLM
from strata.launch.lora_registry import LoRARequest
from strata.worker.lora_files import CONFIG_FILE, LORA_MODULES, WEIGHTS_FILE, linear_shapes
from strata.worker.model_config import read_model_config
from strata.worker.model_loader import resolve_model_path


def write_random_adapter(model_path: Path, path: Path, rank: int, seed: int) -> None:
    """A PEFT LoRA directory of rank ``rank`` on every layer's seven linears, random A and B."""
    config = read_model_config(model_path)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out_features, in_features) in linear_shapes(config).items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, path / WEIGHTS_FILE)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_MODULES)}
    (path / CONFIG_FILE).write_text(json.dumps(adapter_config))


def throughput(args: argparse.Namespace, adapters: list[LoRARequest]) -> dict[str, object]:
    workload = Workload(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(args.model, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank) as llm:
        corpus = llm.tokenizer.encode(CORPUS, add_special_tokens=False)
        prompts = synthetic_prompts(corpus, workload)
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        warmup = [corpus[::-1][:64]] * (len(adapters) + 1)
        llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, lora_request=[None, *adapters])
        best = {"base": float("inf"), "adapters": float("inf")}
        for _ in range(args.repeats):
            for label, requests in (("base", None), ("adapters", spread)):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
                best[label] = min(best[label], time.perf_counter() - start)
    tokens = len(prompts) * args.output_len
    base, adapted = tokens / best["base"], tokens / best["adapters"]
    return {
        "num_prompts": len(prompts),
        "num_adapters": len(adapters),
        "rank": args.rank,
        "base_output_tokens_per_s": base,
        "adapters_output_tokens_per_s": adapted,
        "ratio": adapted / base,
    }


def swap(args: argparse.Namespace, adapters: list[LoRARequest]) -> dict[str, object]:
    one_token = SamplingParams(temperature=0, max_tokens=1)
    with LLM(args.model, enable_lora=True, max_loras=1, max_cpu_loras=len(adapters), max_lora_rank=args.rank) as llm:
        corpus = llm.tokenizer.encode(CORPUS, add_special_tokens=False)
        fresh = (cyclic_slice(corpus, 97 * i, args.swap_prompt_len) for i in range(10**6))
        for adapter in adapters:  # read each from disk once: afterwards all are in CPU memory
            llm.generate(next(fresh), one_token, use_tqdm=False, lora_request=adapter)
        in_slot, swapped = [], []
        for i in range(args.repeats):
            adapter = adapters[i % len(adapters)]
            for times in (swapped, in_slot):  # the first request swaps it in, the second finds it
                start = time.perf_counter()
                llm.generate(next(fresh), one_token, use_tqdm=False, lora_request=adapter)
                times.append(time.perf_counter() - start)
    return {
        "prompt_len": args.swap_prompt_len,
        "first_token_in_slot_ms": statistics.median(in_slot) * 1e3,
        "first_token_swapped_in_ms": statistics.median(swapped) * 1e3,
        "swap_adds_ms": (statistics.median(swapped) - statistics.median(in_slot)) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len-min", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--swap-prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_path = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory(prefix="strata-lora-bench-") as directory:
        adapters = []
        for i in range(args.num_adapters):
            write_random_adapter(model_path, Path(directory) / f"adapter{i}", args.rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", str(Path(directory) / f"adapter{i}")))
        print(json.dumps({"throughput": throughput(args, adapters), "swap": swap(args, adapters)}, indent=2))


if __name__ == "__main__":
    main()
