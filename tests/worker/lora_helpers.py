"""Shared by the LoRA worker tests: a tiny llama with two PEFT adapters, and greedy decoding
through ``ModelRunner.execute`` with hand-built steps."""

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedConfig, PreTrainedModel

from strata.engine_core.protocol import (
    CachedRequestData, LoRAAdapter, LoRASlotLoad, NewRequestData, SchedulerOutput, pack_handles, unpack_tokens,
)
from strata.engine_core.sampling_params import SamplingParams
from strata.worker.config import WorkerConfig
from strata.worker.model_runner import ModelRunner

from model_factory import save_tiny_lora, save_tiny_model, tiny_llama_config

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCKS_PER_REQUEST = 4


@dataclass
class TinyAdapters:
    """A tiny llama, its HF reference, and adapters with the merged HF model each one makes."""

    model_dir: Path
    base: PreTrainedModel
    adapters: list[LoRAAdapter]
    merged: list[PreTrainedModel]


def save_tiny_adapters(path: Path, config: PreTrainedConfig | None = None) -> TinyAdapters:
    """A tiny model of ``config`` (default: tiny llama) and two adapters. Adapter 1: every
    module, rank 8. Adapter 2: q, v and down, rank 4, rsLoRA."""
    model_dir = path / "model"
    base = save_tiny_model(config or tiny_llama_config(), model_dir)
    first = save_tiny_lora(base, path / "all", ALL_MODULES, rank=8, seed=1)
    second = save_tiny_lora(base, path / "some", ("q_proj", "v_proj", "down_proj"), rank=4, seed=2, use_rslora=True)
    adapters = [LoRAAdapter("all", 1, str(path / "all")), LoRAAdapter("some", 2, str(path / "some"))]
    return TinyAdapters(model_dir, base, adapters, [first, second])


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
