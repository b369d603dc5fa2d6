"""Shared by the worker tests: a driver that runs our model through a
paged KV cache the way the model runner does (shuffled block tables, ragged batches)."""

import socket
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.multiprocessing as mp

from strata.kernels import cpu_decoder_layer, cpu_linear, gguf_linear
from strata.worker.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, get_attention_backend
from strata.worker.cpu_linear_plan import (
    CpuLinearPlan, QuantizedLinearPlan, apply_cpu_linear_plan, apply_quantized_linear_plan,
)
from strata.worker.llama import LlamaForCausalLM
from strata.worker.model_loader import gguf_file, load_model, quantized_weights_file, resolve_model_path
from strata.worker.parallel_state import TensorParallel
from strata.worker.scaled_weights import ScaledScheme

SINGLE_RANK = TensorParallel(rank=0, size=1)
JOIN_TIMEOUT_S = 120
# What a CPU without native bfloat16 runs: float32 GEMMs, every step the kernels take streamed.
STREAMED_FLOAT32 = CpuLinearPlan(torch.float32, False, cpu_linear.MAX_ROWS, "tests: float32 GEMMs, streamed decode steps")


def load_planned(
    path: Path, plan: CpuLinearPlan, backend: AttentionBackend, tp: TensorParallel = SINGLE_RANK, dtype: torch.dtype = torch.bfloat16
) -> LlamaForCausalLM:
    """A model loaded on the CPU with its linears following ``plan``, as the engine does."""
    model = load_model(path, dtype, tp, backend, "cpu")
    apply_cpu_linear_plan(model, plan)
    return model


def load_ours(path: Path, tp: TensorParallel = SINGLE_RANK, device: str = "cpu") -> LlamaForCausalLM:
    return load_model(path, torch.float32, tp, TorchAttentionBackend(), device)


def load_scaled(
    path: Path, scheme: ScaledScheme, tp: TensorParallel = SINGLE_RANK, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """The model at ``path`` with 8-bit linears as ``scheme`` says (``--quantization fp8/int8``)."""
    return load_model(path, dtype, tp, TorchAttentionBackend(), device, scaled=scheme)


def load_gguf_blocks(model: str | None, tp: TensorParallel = SINGLE_RANK, block_rows: int = 16) -> LlamaForCausalLM:
    """The GGUF model ``model`` names (None: the default model) as the engine loads it under
    ``--quantization gguf`` on the CPU, in float32, steps of up to ``block_rows`` rows on the blocks."""
    blocks_from = quantized_weights_file("gguf", str(gguf_file(model)), "cpu")
    backend = get_attention_backend("cpu", torch.device("cpu"))
    loaded = load_model(resolve_model_path(model), torch.float32, tp, backend, "cpu", blocks_from=blocks_from)
    every_type = {code: block_rows for code in gguf_linear.TYPES.values()}
    apply_quantized_linear_plan(loaded, QuantizedLinearPlan(every_type, torch.float32, "tests"))
    return loaded


class PagedRunner:
    """Runs ``model`` over ragged batches through a paged KV cache with shuffled block ids."""

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 16, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        weight = next(model.parameters())
        self.device = weight.device
        shape = (2, num_blocks, block_size, model.num_kv_heads_per_rank, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=weight.dtype, device=self.device) for _ in range(model.num_layers)]
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.block_tables: list[list[int]] = []
        self.num_cached: list[int] = []

    def add_sequence(self, max_tokens: int) -> int:
        """Reserve blocks for a sequence of up to ``max_tokens`` tokens; returns its index."""
        num_blocks = -(-max_tokens // self.block_size)
        self.block_tables.append([self.free_blocks.pop() for _ in range(num_blocks)])
        self.num_cached.append(0)
        return len(self.block_tables) - 1

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run each ``(sequence, new tokens)`` chunk in one forward; return each chunk's logits."""
        lengths = [len(tokens) for _, tokens in chunks]
        seqs = [seq for seq, _ in chunks]
        starts = torch.tensor([self.num_cached[seq] for seq in seqs])
        seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lengths))
        offsets = torch.cat([torch.arange(n) for n in lengths])
        positions = starts[seq_of_token] + offsets
        max_blocks = max(len(self.block_tables[seq]) for seq in seqs)
        block_tables = torch.tensor(
            [self.block_tables[seq] + [0] * (max_blocks - len(self.block_tables[seq])) for seq in seqs]
        )
        blocks = block_tables[seq_of_token, positions // self.block_size]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=(blocks * self.block_size + positions % self.block_size).to(device),
            block_tables=block_tables.int().to(device),
            query_start_loc=torch.cumsum(torch.tensor([0] + lengths), 0).int().to(device),
            seq_lens=(starts + torch.tensor(lengths)).int().to(device),
            max_query_len=max(lengths),
        )
        input_ids = torch.tensor([token for _, tokens in chunks for token in tokens], device=device)
        hidden = self.model(input_ids, positions.to(device), self.kv_caches, meta)
        for seq, n in zip(seqs, lengths):
            self.num_cached[seq] += n
        return list(self.model.compute_logits(hidden).split(lengths))


def greedy_decode(
    runner: PagedRunner, prompts: list[list[int]], num_tokens: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill all prompts in one batch, then decode them together greedily.

    Returns the generated tokens per prompt and the logits of every token run, concatenated.
    """
    seqs = [runner.add_sequence(len(prompt) + num_tokens) for prompt in prompts]
    logits = runner.step(list(zip(seqs, prompts)))
    all_logits = list(logits)
    generated = [[int(seq_logits[-1].argmax())] for seq_logits in logits]
    for _ in range(num_tokens - 1):
        logits = runner.step([(seq, [tokens[-1]]) for seq, tokens in zip(seqs, generated)])
        all_logits += logits
        for tokens, seq_logits in zip(generated, logits):
            tokens.append(int(seq_logits[-1].argmax()))
    return generated, torch.cat(all_logits)




def spawn_ranks(target: Callable[..., None], args: tuple, num_ranks: int) -> None:
    """Run ``target(rank, port, *args)`` in ``num_ranks`` spawned processes (``port``: a free
    one for the group's rendezvous) and assert that every one exits cleanly."""
    context = mp.get_context("spawn")
    port = _free_port()
    ranks = [context.Process(target=target, args=(rank, port, *args)) for rank in range(num_ranks)]
    try:
        for process in ranks:
            process.start()
        # Stop waiting as soon as one rank fails: its peer would block in a collective until timeout.
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        running = list(ranks)
        while running and not any(process.exitcode for process in ranks):
            timeout = max(0.0, deadline - time.monotonic())
            if not wait([process.sentinel for process in running], timeout=timeout):
                break
            running = [process for process in running if process.exitcode is None]
        exit_codes = [process.exitcode for process in ranks]
        assert exit_codes == [0] * num_ranks, f"rank exit codes (None = still running): {exit_codes}"
    finally:
        for process in ranks:
            if process.is_alive():
                process.terminate()
                process.join(5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str, module: ModuleType = cpu_decoder_layer) -> list[int]:
    """Count the calls of ``module.name`` from now on, in the returned list's one item."""
    calls = [0]
    original: Callable[..., object] = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
