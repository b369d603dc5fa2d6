"""One engine held loaded while ``compare_vllm`` times it: strata's or vLLM's offline ``LLM``, or
llama.cpp through llama-cpp-python's bindings.

Run by path (the peers' environments have no strata to find it in) with the interpreter of the
engine's own environment (a peer's must never share strata's), so this file imports only the
standard library at the top and the engine it drives when it loads it. Protocol, one JSON
object a line: after loading it prints ``{"ready": true, "rss_mib": M}`` (the resident memory of
this process and of the engine's processes under it, ``resident_mib``); then for each line
``{"prompts": [[ids]], "max_tokens": N}`` on stdin it clears the prefix cache, generates greedily
with EOS ignored, checks that every request made exactly N tokens, and prints ``{"elapsed_s": S,
"output_tokens": T}``. EOF on stdin ends it. Replies start with ``REPLY_MARK``: the engines log
to stdout too.
"""

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable

REPLY_MARK = "@compare "
LLAMA_CPP_SEQUENCES = 64  # the most prompts a run may have: the workloads' largest batch
LLAMA_CPP_BATCH = 512
LLAMA_CPP_CONTEXT = 65536  # KV-cache tokens over all sequences: 64 x (512 + 128) fits
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
        kv_cache_memory=args.kv_cache_gib << 30, worker_timeout_s=WORKER_TIMEOUT_S, quantization=args.quantization,
        **drafts,
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


def load_llama_cpp(args: argparse.Namespace) -> tuple[Callable[[], None], Generate, Callable[[], None]]:
    """llama.cpp's own batched decoding: every prompt a sequence of one unified KV cache, the
    prompts' tokens in batches of up to ``LLAMA_CPP_BATCH``, then one token per sequence per
    step, greedy (argmax of the logits), EOS ignored."""
    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = LLAMA_CPP_CONTEXT
    params.n_batch = params.n_ubatch = LLAMA_CPP_BATCH
    params.n_seq_max, params.kv_unified = LLAMA_CPP_SEQUENCES, True
    params.n_threads = params.n_threads_batch = args.threads
    context = llama_cpp.llama_init_from_model(model, params)
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(LLAMA_CPP_BATCH, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run (sequence, position, token, wants logits) entries; the greedy token of each that wanted logits."""
        picked = []
        for start in range(0, len(entries), LLAMA_CPP_BATCH):
            chunk = entries[start : start + LLAMA_CPP_BATCH]
            for i, (sequence, position, token, wants) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
                batch.seq_id[i][0], batch.logits[i] = sequence, wants
            batch.n_tokens = len(chunk)
            if llama_cpp.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for i, (_, _, _, wants) in enumerate(chunk):
                if wants:
                    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, i), shape=(vocab_size,))
                    picked.append(int(logits.argmax()))
        return picked

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        if len(prompts) > LLAMA_CPP_SEQUENCES:
            raise ValueError(f"the llama.cpp driver holds at most {LLAMA_CPP_SEQUENCES} sequences")
        made = [[] for _ in prompts]
        prefill = [
            (seq, pos, token, pos == len(prompt) - 1) for seq, prompt in enumerate(prompts) for pos, token in enumerate(prompt)
        ]
        for seq, token in enumerate(decode(prefill)):
            made[seq].append(token)
        while len(made[0]) < max_tokens:
            step = [(seq, len(prompt) + len(tokens) - 1, tokens[-1], True) for seq, (prompt, tokens) in enumerate(zip(prompts, made))]
            for tokens, token in zip(made, decode(step)):
                tokens.append(token)
        return [len(tokens) for tokens in made]

    def clear() -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)

    def shutdown() -> None:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(context)
        llama_cpp.llama_model_free(model)

    return clear, generate, shutdown


def resident_mib() -> float:
    """The resident memory of this process and of every process under it (an engine's EngineCore
    and workers hold its weights and KV cache), in MiB: their proportional set sizes (``Pss``),
    so that pages they share, such as libraries, count once."""
    total_kib = 0
    for pid in [os.getpid(), *descendants(os.getpid())]:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                total_kib += next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
    return total_kib / 1024


def descendants(root: int) -> list[int]:
    """The processes under ``root``: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = int(stat.read().rpartition(")")[2].split()[1])  # the name, in parentheses, may hold spaces
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        children.setdefault(parent, []).append(pid)
    found, pending = [], [root]
    while pending:
        found_now = children.get(pending.pop(), [])
        found += found_now
        pending += found_now
    return found


def reply(message: dict) -> None:
    print(REPLY_MARK + json.dumps(message), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=list(LOADERS), required=True)
    parser.add_argument("--model", required=True, help="an HF model directory or GGUF file the engine can load")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--executor", default="mp", help="strata only: uni, mp or ray")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="strata only; vLLM's is VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--ngram-drafts", type=int, default=0, help="n-gram speculative decoding with this many drafts (0: off)")
    parser.add_argument("--quantization", default="auto", help="strata only")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp only")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally: the engine stops its processes
    reset_prefix_cache, generate, shutdown = LOADERS[args.engine](args)
    try:
        reply({"ready": True, "rss_mib": resident_mib()})
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


LOADERS = {"strata": load_strata, "vllm": load_vllm, "llama.cpp": load_llama_cpp}

if __name__ == "__main__":
    main()
