"""Speculative decoding on and off, each in a fresh engine, on two workloads:

    python -m strata.launch.bench.speculative [--executor uni] [--num-speculative-tokens 4] [--json OUT]
        [--method ngram | --method draft --speculative-model DIR [--speculative-draft-layers N]]

- ``copy``: one request that repeats a 1,200-character passage word for word (a chat prompt;
  256 greedy tokens, EOS ignored), where n-gram drafts find what comes next in the prompt:
  single-stream decode speed.
- ``prose``: ``strata bench throughput``'s default workload (64 prompts of 32-512 tokens of
  prose, 128 greedy tokens each), whose continuations rarely repeat the prompt: what drafts
  that do not match cost at batch 64.

``--method draft`` proposes with a draft model instead (``--speculative-model`` the default
model's own path and ``--speculative-draft-layers N``: a self-draft of its first N layers).

Each timed run follows an untimed one of the same requests (warm caches, no compile in the
timing); the prefix cache is reset between them. Prints output tokens/s with drafts off and
on, the ratio, the share of drafts accepted and the mean tokens a verified step produced, with
``lscpu``'s CPU.
"""

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.bench.compare_vllm import CpuInfo
from strata.launch.bench.throughput import COPY_TOKENS, CORPUS, Workload, copy_prompt, synthetic_prompts
from strata.launch.llm import LLM


@dataclass
class Measurement:
    workload: str
    speculative: bool
    output_tokens_per_s: float
    draft_tokens: int
    accepted_tokens: int
    verifications: int

    @property
    def acceptance(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Mean tokens a step that verified drafts produced: the accepted ones plus its own."""
        return 1 + self.accepted_tokens / self.verifications if self.verifications else 1.0


def measure(workload: str, speculative: bool, engine_args: dict, speculative_args: dict) -> Measurement:
    """``workload`` in a fresh engine, with ``speculative_args`` if ``speculative``."""
    with LLM(**engine_args, **(speculative_args if speculative else {})) as llm:
        if workload == "copy":
            prompts = [copy_prompt(llm.tokenizer)]
            params = SamplingParams(temperature=0, max_tokens=COPY_TOKENS, ignore_eos=True)
        else:
            prompts = synthetic_prompts(llm.tokenizer.encode(CORPUS, add_special_tokens=False), Workload())
            params = SamplingParams(temperature=0, max_tokens=Workload().output_len, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()
        before = llm.stats
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        after = llm.stats
        assert before is not None and after is not None
        return Measurement(
            workload, speculative, sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
            after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens,
            after.spec_verifications - before.spec_verifications,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executor", default="uni", choices=("uni", "mp"))
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--workloads", default="copy,prose", help="comma-separated: copy, prose")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("--method", default="ngram", choices=("ngram", "draft"), help="how drafts are proposed")
    parser.add_argument("--speculative-model", help="draft: the draft model (the model's own path for a self-draft)")
    parser.add_argument("--speculative-draft-layers", type=int, help="draft: its first N layers only")
    args = parser.parse_args()
    engine_args = {"executor": args.executor, "num_speculative_tokens": args.num_speculative_tokens}
    speculative_args = {"speculative_method": args.method}
    if args.method == "draft":
        speculative_args |= {
            "speculative_model": args.speculative_model, "speculative_draft_layers": args.speculative_draft_layers,
        }
    print(f"drafts: {args.method}" + (f" ({args.speculative_model}, layers {args.speculative_draft_layers or 'all'})" if args.method == "draft" else ""))
    print(CpuInfo.read().describe())
    print("| workload | drafts off tok/s | drafts on tok/s | on / off | drafts accepted | tokens per verified step |")
    print("|---|---|---|---|---|---|")
    report = []
    for workload in args.workloads.split(","):
        off, on = measure(workload, False, engine_args, speculative_args), measure(workload, True, engine_args, speculative_args)
        report += [asdict(off), asdict(on)]
        print(
            f"| {workload} | {off.output_tokens_per_s:.1f} | {on.output_tokens_per_s:.1f} | "
            f"{on.output_tokens_per_s / off.output_tokens_per_s:.2f} | {on.acceptance:.0%} | {on.tokens_per_verification:.2f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
