"""What each spawned rank of the worker-level tensor-parallel tests runs: a model's logits, or
LoRA adapters' greedy tokens.

A spawned rank imports the module its target lives in. This one stays clear of transformers
(the test modules import its config and model classes through ``model_factory``), so a rank
starts in about a second instead of several: the prompts come from the parent.
"""

import json
from pathlib import Path

import torch

from strata.engine_core.protocol import LoRAAdapter, LoRASlotLoad
from strata.worker.attention import CpuAttentionBackend
from strata.worker.llama import LlamaForCausalLM
from strata.worker.model_runner import ModelRunner
from strata.worker.parallel_state import TensorParallel, init_tensor_parallel
from strata.worker.scaled_weights import ScaledScheme

from lora_steps import greedy_steps, lora_config
from worker_helpers import (
    STREAMED_FLOAT32, PagedRunner, greedy_decode, load_gguf_blocks, load_ours, load_planned, load_scaled, spawn_ranks,
)

TP_SIZE = 2
DECODE_TOKENS = 3


def load_int8(model_dir: Path, tp: TensorParallel, device: str = "cpu") -> LlamaForCausalLM:
    return load_scaled(model_dir, ScaledScheme(torch.int8, w8a8=False), tp, device)


def load_widened_bf16(model_dir: Path, tp: TensorParallel, device: str = "cpu") -> LlamaForCausalLM:
    """A bfloat16 model as the engine loads it on a CPU without native bfloat16."""
    return load_planned(model_dir, STREAMED_FLOAT32, CpuAttentionBackend(), tp)


# How a rank loads its model: a float32 checkpoint, a bfloat16 one on fused layers, the default
# model on its GGUF blocks, a float32 checkpoint quantized to INT8 at load.
LOADERS = {
    "float32": load_ours,
    "bfloat16": load_widened_bf16,
    "gguf": lambda model_dir, tp, device: load_gguf_blocks(None, tp),
    "int8": load_int8,
}


def run_ranks(
    model_dir: Path, out_dir: Path, prompts: list[list[int]], device: str = "cpu", load: str = "float32"
) -> list[torch.Tensor]:
    """Every rank's logits of each step of greedily decoding ``prompts``."""
    spawn_ranks(_run_rank, (model_dir, out_dir, prompts, device, load), TP_SIZE)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(TP_SIZE)]


def _run_rank(rank: int, port: int, model_dir: Path, out_dir: Path, prompts: list[list[int]], device: str, load: str) -> None:
    """One spawned rank: prefill and decode, save the logits of every step for the parent.
    gloo on any device: on CUDA it reduces CUDA tensors, so two ranks can share one GPU."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    tp = init_tensor_parallel(rank, TP_SIZE, f"tcp://127.0.0.1:{port}", device, backend="gloo")
    try:
        model = LOADERS[load](model_dir, tp, device)
        _, logits = greedy_decode(PagedRunner(model), prompts, DECODE_TOKENS)
        torch.save(logits.cpu(), out_dir / f"rank{rank}.pt")
    finally:
        tp.destroy()


def run_lora_ranks(
    model_dir: Path, adapters: list[LoRAAdapter], prompts: list[list[int]], slots: list[int], num_tokens: int, out: Path
) -> list[list[int]]:
    """Each prompt's greedy tokens from two ranks of a LoRA-enabled runner, its rows on ``slots``
    (-1: the base model) after ``adapters`` are loaded into slots 0, 1, ..."""
    spawn_ranks(_run_lora_rank, (model_dir, adapters, prompts, slots, num_tokens, out), TP_SIZE)
    return json.loads(out.read_text())


def _run_lora_rank(
    rank: int, port: int, model_dir: Path, adapters: list[LoRAAdapter], prompts: list[list[int]], slots: list[int],
    num_tokens: int, out: Path,
) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    tp = init_tensor_parallel(rank, TP_SIZE, f"tcp://127.0.0.1:{port}", "cpu", backend="gloo")
    try:
        runner = ModelRunner(lora_config(model_dir, tensor_parallel_size=TP_SIZE, rank=rank), tp)
        loads = [LoRASlotLoad(slot, adapter) for slot, adapter in enumerate(adapters)]
        tokens = greedy_steps(runner, prompts, slots, loads, num_tokens)
        if rank == 0:
            out.write_text(json.dumps(tokens))
    finally:
        tp.destroy()
