"""One engine held loaded while ``compare_vllm`` times it: strata's or vLLM's offline ``LLM``.

Run by path (vLLM's environment has no strata to find it in) with the interpreter of the
engine's own environment (vLLM's must never share strata's), so this file imports only the
standard library at the top and the engine it drives when it loads it. Protocol, one JSON
object a line: after loading it prints ``{"ready": true}``; then for each line ``{"prompts":
[[ids]], "max_tokens": N}`` on stdin it clears the prefix cache, generates greedily with EOS
ignored, checks that every request made exactly N tokens, and prints ``{"elapsed_s": S,
"output_tokens": T}``. EOF on stdin ends it. Replies start with ``REPLY_MARK``: the engines log
to stdout too.
"""

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable

REPLY_MARK = "@compare "
NGRAM_MIN, NGRAM_MAX = 1, 4  # strata's defaults, given to vLLM's n-gram proposer too

# A long prefill on a machine shared with other work can take longer than the engine's default.
WORKER_TIMEOUT_S = 600.0

Generate = Callable[[list[list[int]], int], list[int]]  # prompts, max_tokens -> tokens made per request


def load_strata(args: argparse.Namespace) -> tuple[Callable[[], None], Generate, Callable[[], None]]:
    from strata.engine_core.sampling_params import SamplingParams
    from strata.launch.llm import LLM

    drafts = {"speculative_method": "ngram", "num_speculative_tokens": args.ngram_drafts} if args.ngram_drafts else {}
    llm = LLM(
        args.model, executor=args.executor, dtype=args.dtype, max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_gib << 30, worker_timeout_s=WORKER_TIMEOUT_S, **drafts,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [len(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]

    return llm.reset_prefix_cache, generate, llm.shutdown


def load_vllm(args: argparse.Namespace) -> tuple[Callable[[], None], Generate, Callable[[], None]]:
    from vllm import LLM, SamplingParams

    drafts = {}
    if args.ngram_drafts:
        drafts["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": args.ngram_drafts,
            "prompt_lookup_min": NGRAM_MIN, "prompt_lookup_max": NGRAM_MAX,
        }
    llm = LLM(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=True, seed=0, **drafts
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(output.outputs[0].token_ids) for output in outputs]

    return llm.reset_prefix_cache, generate, lambda: None  # vLLM stops its engine process at exit


def reply(message: dict) -> None:
    print(REPLY_MARK + json.dumps(message), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["strata", "vllm"], required=True)
    parser.add_argument("--model", required=True, help="an HF model directory both engines can load")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--executor", default="mp", help="strata only: uni, mp or ray")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="strata only; vLLM's is VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--ngram-drafts", type=int, default=0, help="n-gram speculative decoding with this many drafts (0: off)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally: the engine stops its processes
    reset_prefix_cache, generate, shutdown = (load_strata if args.engine == "strata" else load_vllm)(args)
    try:
        reply({"ready": True})
        for line in sys.stdin:
            job = json.loads(line)
            reset_prefix_cache()
            start = time.perf_counter()
            made = generate(job["prompts"], job["max_tokens"])
            elapsed = time.perf_counter() - start
            if any(count != job["max_tokens"] for count in made):
                raise RuntimeError(f"{args.engine}: requests made {sorted(set(made))} tokens, not {job['max_tokens']}")
            reply({"elapsed_s": elapsed, "output_tokens": sum(made)})
    finally:
        shutdown()


if __name__ == "__main__":
    main()
