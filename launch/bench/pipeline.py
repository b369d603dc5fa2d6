"""Pipeline parallelism against tensor parallelism on the same decode workload, each in a fresh
engine (``--executor mp``):

    python -m strata.launch.bench.pipeline [--batch 32] [--prompt-len 32] [--output-len 128]
        [--model DIR] [--dtype float32] [--pipeline-layer-partition 18,12] [--json OUT]

Every run decodes ``--batch`` requests of ``--prompt-len`` tokens (greedy, EOS ignored) at once,
after an untimed run of the same requests. Printed per layout (one rank, TP=2, PP=2):

- output tokens/s;
- per stage, the pipeline bubble: the share of the run's wall time its first rank did not
  compute (waiting for the previous stage's hidden states, or for a step to come), while
  every request was waiting for tokens;
- the bytes of step messages each rank got from the EngineCore per step, and per request in
  a step (a pipeline's micro-batches hold a share of the requests each).
"""

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.bench.compare_vllm import CpuInfo
from strata.launch.llm import LLM

LAYOUTS = {"one rank": {}, "TP=2": {"tensor_parallel_size": 2}, "PP=2": {"pipeline_parallel_size": 2}}


@dataclass
class Measurement:
    layout: str
    output_tokens_per_s: float
    bubble_by_stage: list[float]
    step_bytes_per_rank: float
    requests_per_step: float


def measure(layout: str, args: argparse.Namespace) -> Measurement:
    prompts = [[3 + (request * 7 + i) % 90 for i in range(args.prompt_len)] for request in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine_args = dict(LAYOUTS[layout])
    if "pipeline_parallel_size" in engine_args and args.pipeline_layer_partition:
        engine_args["pipeline_layer_partition"] = [int(n) for n in args.pipeline_layer_partition.split(",")]
    with LLM(args.model, executor="mp", dtype=args.dtype, max_num_seqs=args.batch, **engine_args) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()
        before = llm.engine.call_utility("debug_state")
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        after = llm.engine.call_utility("debug_state")
    stages = LAYOUTS[layout].get("pipeline_parallel_size", 1)
    busy = [float(after[f"busy_seconds_stage{s}"]) - float(before[f"busy_seconds_stage{s}"]) for s in range(stages)]
    return Measurement(
        layout,
        sum(len(o.outputs[0].token_ids) for o in outputs) / wall,
        [1 - seconds / wall for seconds in busy],
        float(after["step_bytes_per_rank"]),
        args.batch / stages,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--pipeline-layer-partition", help="PP=2: layers per stage, e.g. 18,12 (default: balanced by layer count)"
    )
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated: {', '.join(LAYOUTS)}")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args()
    print(CpuInfo.read().describe())
    print(f"batch {args.batch} decode, {args.prompt_len}-token prompts, {args.output_len} tokens each")
    print("| layout | output tok/s | bubble by stage | step bytes per rank | per request in a step |")
    print("|---|---|---|---|---|")
    report = [measure(layout, args) for layout in args.layouts.split(",")]
    for m in report:
        bubbles = " / ".join(f"{b:.0%}" for b in m.bubble_by_stage)
        per_request = m.step_bytes_per_rank / m.requests_per_step
        print(f"| {m.layout} | {m.output_tokens_per_s:.1f} | {bubbles} | {m.step_bytes_per_rank:.0f} | {per_request:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(m) for m in report], indent=2))


if __name__ == "__main__":
    main()
