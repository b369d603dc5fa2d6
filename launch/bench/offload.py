"""``strata bench offload``: a long-context multi-turn workload with and without the CPU tier.

``conversations`` chats each start from their own long document; every turn re-sends the
whole history plus a new question, and the GPU KV pool holds only a few conversations. Without
offloading, a conversation's prefix is evicted before its next turn and recomputed; with it,
the prefix comes back from CPU memory. Both runs use the same engine flags otherwise and the
same greedy outputs, so their time to first token, prefill work and throughput compare directly.
"""

import dataclasses
import statistics
import time
from dataclasses import dataclass

from strata.engine_core.sampling_params import SamplingParams
from strata.launch.bench.throughput import CORPUS, cyclic_slice
from strata.runtime.engine_args import EngineArgs
from strata.launch.llm import LLM


@dataclass
class OffloadWorkload:
    conversations: int = 6
    turns: int = 4
    document_len: int = 768  # tokens of the document that opens each conversation
    question_len: int = 24
    output_len: int = 16
    gpu_blocks: int = 120  # the GPU pool: room for about two conversations
    cpu_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be >= 1")


def _run(args: EngineArgs, workload: OffloadWorkload, offload: bool) -> dict[str, float]:
    engine_args = dataclasses.replace(
        args, num_gpu_blocks=workload.gpu_blocks, kv_offload_cpu_bytes=workload.cpu_bytes if offload else None
    )
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    with LLM(**dataclasses.asdict(engine_args)) as llm:
        corpus = llm.tokenizer.encode(CORPUS, add_special_tokens=False)
        histories = [
            cyclic_slice(corpus, 997 * c, workload.document_len) for c in range(workload.conversations)
        ]
        # Warm up on text no conversation uses, so the first timed request pays no one-off costs.
        llm.generate([cyclic_slice(corpus, 50_000, 32)], SamplingParams(max_tokens=2), use_tqdm=False)
        ttfts: list[float] = []
        outputs: list[list[int]] = []
        output_tokens = 0
        started = time.perf_counter()
        for turn in range(workload.turns):
            for c in range(workload.conversations):
                histories[c] = histories[c] + cyclic_slice(corpus, 31 * (turn * 101 + c), workload.question_len)
            # One request per conversation at a time, in turn: each waits for its history.
            for c in range(workload.conversations):
                (result,) = llm.generate([histories[c]], params, use_tqdm=False)
                completion = result.outputs[0]
                ttfts.append(result.metrics.time_to_first_token or 0.0)
                histories[c] = histories[c] + completion.token_ids
                outputs.append(completion.token_ids)
                output_tokens += len(completion.token_ids)
        elapsed = time.perf_counter() - started
        stats = llm.stats
    ttfts.sort()
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "prefill_tokens": stats.prompt_tokens_computed,
        "offload_hit_rate": stats.offload_hit_tokens / stats.offload_queried_tokens if stats.offload_queried_tokens else 0.0,
        "output_tokens_per_s": output_tokens / elapsed,
        "outputs": outputs,
    }


def run(args: EngineArgs, workload: OffloadWorkload) -> dict[str, object]:
    """Both runs; keys end in ``_off`` / ``_on``, ratios are off / on (higher = offload helps)."""
    off = _run(args, workload, offload=False)
    on = _run(args, workload, offload=True)
    result: dict[str, object] = {"same_outputs": off.pop("outputs") == on.pop("outputs")}
    for name in off:
        result[f"{name}_off"] = off[name]
        result[f"{name}_on"] = on[name]
    result["ttft_ratio"] = off["ttft_mean_s"] / on["ttft_mean_s"]
    result["prefill_ratio"] = off["prefill_tokens"] / max(1, on["prefill_tokens"])
    result["throughput_ratio"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    result.update(executor=args.executor, tensor_parallel_size=args.tensor_parallel_size, workload=dataclasses.asdict(workload))
    return result
