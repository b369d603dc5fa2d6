"""Two gloo ranks with LoRA adapters decode what HF computes with each adapter merged: column-
parallel linears split B by output rows, row-parallel ones A by input columns."""

import json
from pathlib import Path

import torch

from strata.engine_core.protocol import LoRAAdapter, LoRASlotLoad
from strata.worker.model_runner import ModelRunner
from strata.worker.parallel_state import init_tensor_parallel
from worker_helpers import spawn_ranks

from lora_helpers import greedy_steps, lora_config, save_tiny_adapters
from model_factory import hf_greedy, random_prompts

TP_SIZE = 2
NUM_TOKENS = 4
PROMPT_LENGTHS = [9, 14, 5]
SLOTS = [0, 1, -1]


def _run_rank(rank: int, port: int, model_dir: Path, adapters: list[LoRAAdapter], out: Path) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    tp = init_tensor_parallel(rank, TP_SIZE, f"tcp://127.0.0.1:{port}", "cpu", backend="gloo")
    try:
        runner = ModelRunner(lora_config(model_dir, tensor_parallel_size=TP_SIZE, rank=rank), tp)
        prompts = random_prompts(PROMPT_LENGTHS, vocab_size=97)
        loads = [LoRASlotLoad(slot, adapter) for slot, adapter in enumerate(adapters)]
        tokens = greedy_steps(runner, prompts, SLOTS, loads, NUM_TOKENS)
        if rank == 0:
            out.write_text(json.dumps(tokens))
    finally:
        tp.destroy()


def test_two_ranks_with_adapters_decode_as_hf_with_each_adapter_merged(tmp_path):
    tiny = save_tiny_adapters(tmp_path)
    out = tmp_path / "tokens.json"
    spawn_ranks(_run_rank, (tiny.model_dir, tiny.adapters, out), TP_SIZE)
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=97)
    references = [tiny.merged[0], tiny.merged[1], tiny.base]
    assert json.loads(out.read_text()) == [hf_greedy(model, prompt, NUM_TOKENS) for model, prompt in zip(references, prompts)]
