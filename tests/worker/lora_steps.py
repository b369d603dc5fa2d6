"""Greedy decoding through a LoRA-enabled ``ModelRunner.execute`` with hand-built steps. Free of
transformers, so that a spawned rank importing it starts quickly."""

from pathlib import Path

from strata.engine_core.protocol import (
    CachedRequestData, LoRASlotLoad, NewRequestData, SchedulerOutput, pack_handles, unpack_tokens,
)
from strata.engine_core.sampling_params import SamplingParams
from strata.worker.config import WorkerConfig
from strata.worker.model_runner import ModelRunner

BLOCKS_PER_REQUEST = 4


def lora_config(model_dir: Path, **overrides: object) -> WorkerConfig:
    settings = dict(
        model=str(model_dir), dtype="float32", num_gpu_blocks=64, max_num_seqs=8, max_model_len=128,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )
    return WorkerConfig(**(settings | overrides))


def greedy_steps(
    runner: ModelRunner,
    prompts: list[list[int]],
    slots: list[int],
    loads: list[LoRASlotLoad],
    num_tokens: int,
    first_step: int = 1,
) -> list[list[int]]:
    """Prefill every prompt in one step (its rows using ``slots``, ``loads`` put in first),
    then decode ``num_tokens - 1`` more tokens; each request's tokens, then the requests end."""
    greedy = SamplingParams(temperature=0, max_tokens=num_tokens)
    new = [
        NewRequestData(
            f"r{i}", i, prompt, [], greedy, None,
            list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)), 0, len(prompt), slot,
        )
        for i, (prompt, slot) in enumerate(zip(prompts, slots))
    ]
    handles = list(range(len(prompts)))
    output = runner.execute(
        SchedulerOutput(
            step=first_step, new_requests=new, total_num_scheduled_tokens=sum(map(len, prompts)), lora_loads=loads
        )
    )
    tokens = [[token] for token in unpack_tokens(output.sampled_token_ids)]
    for index in range(1, num_tokens):
        step = SchedulerOutput(
            step=first_step + index,
            cached=CachedRequestData(pack_handles(handles)),
            total_num_scheduled_tokens=len(handles),
        )
        for row, token in zip(tokens, unpack_tokens(runner.execute(step).sampled_token_ids)):
            row.append(token)
    runner.execute(SchedulerOutput(step=first_step + num_tokens, finished_handles=handles))
    return tokens
