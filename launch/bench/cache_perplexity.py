"""What a narrower KV cache costs in quality: the perplexity of a text under each
``--kv-cache-dtype``, from the engine's prompt logprobs (the whole text one prefill, its keys and
values written to the cache and read back by the attention of every later position):

    python -m strata.launch.bench.cache_perplexity [--kv-cache-dtypes auto,bfloat16,fp8]
        [--text FILE] [--tokens 2048] [--model ...]

The text defaults to CPython's LICENSE.txt beside the standard library (most installations have
it). Prints, per cache dtype, the perplexity of the first ``--tokens`` tokens and the mean
absolute difference of each token's logprob from the first dtype's, with ``lscpu``'s CPU.
"""

import argparse
import math
import os
from pathlib import Path

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.bench.compare_vllm import CpuInfo
from strata.launch.llm import LLM

DEFAULT_TEXT = Path(os.__file__).parent / "LICENSE.txt"


def token_logprobs(kv_cache_dtype: str, model: str | None, text: str, tokens: int) -> list[float]:
    """The logprob of each of the text's first ``tokens`` tokens after the first, given those before it."""
    with LLM(model, executor="uni", kv_cache_dtype=kv_cache_dtype, max_model_len=tokens + 1) as llm:
        ids = llm.tokenizer(text)["input_ids"][:tokens]
        (output,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [entry[token] for token, entry in zip(ids[1:], output.prompt_logprobs[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtypes", default="auto,bfloat16,fp8")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--model", help="default: the default model")
    args = parser.parse_args()
    if not args.text.is_file():
        parser.error(f"no text at {args.text} (some distributions leave CPython's LICENSE.txt out); pass --text FILE")
    text = args.text.read_text()
    print(CpuInfo.read().describe())
    first = None
    for name in args.kv_cache_dtypes.split(","):
        logprobs = token_logprobs(name, args.model, text, args.tokens)
        first = first or logprobs
        drift = sum(abs(a - b) for a, b in zip(logprobs, first)) / len(logprobs)
        print(
            f"--kv-cache-dtype {name}: perplexity {math.exp(-sum(logprobs) / len(logprobs)):.4f} over "
            f"{len(logprobs)} tokens of {args.text.name}; mean |logprob - {args.kv_cache_dtypes.split(',')[0]}'s| {drift:.4f}"
        )


if __name__ == "__main__":
    main()
