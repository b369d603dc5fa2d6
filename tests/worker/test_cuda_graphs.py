"""The bookkeeping behind CUDA graphs, on the CPU: the ladder of captured sizes, which steps
replay one, and the padded forward through persistent buffers that a graph captures."""

import logging

import numpy as np
import pytest
import torch

from strata.worker.attention import AttentionMetadata, TorchAttentionBackend, TritonAttentionBackend
from strata.worker.cuda_graphs import PaddedDecode, graph_batch_sizes, padded_batch_size
from strata.worker.config import WorkerConfig
from strata.worker.input_batch import StepInputs
from strata.worker.model_runner import cuda_graph_sizes
from strata.worker.model_loader import load_model
from strata.worker.parallel_state import TensorParallel

from model_factory import random_prompts, tiny_llama_config
from worker_helpers import PagedRunner

# Compiled on CUDA where present (the padded forward is what a graph captures), else the CPU
# with Triton interpreted (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_MODEL_LEN = 1024  # the graphs' hint: split-KV cuts it into partitions these short contexts leave empty
BLOCK_SIZE = 16


def test_default_ladder_doubles_then_steps_by_eight_up_to_max_num_seqs() -> None:
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]


def test_requested_sizes_are_sorted_and_must_fit_max_num_seqs() -> None:
    assert graph_batch_sizes(64, [32, 1, 8, 8]) == [1, 8, 32]
    with pytest.raises(ValueError, match=r"cuda_graph_sizes must lie in 1..max_num_seqs \(64\), got \[128\]"):
        graph_batch_sizes(64, [1, 128])


@pytest.mark.parametrize("batch,padded", [(1, 1), (3, 4), (4, 4), (9, 16), (17, None)])
def test_a_batch_runs_at_the_smallest_size_that_holds_it(batch: int, padded: int | None) -> None:
    assert padded_batch_size([1, 2, 4, 8, 16], batch) == padded


CUDA = torch.device("cuda")  # only named: deciding what to capture touches no GPU


def test_the_triton_backend_on_cuda_captures_the_ladder() -> None:
    config = WorkerConfig(model="unused", max_num_seqs=8)
    assert cuda_graph_sizes(config, TensorParallel(0, 1), CUDA, TritonAttentionBackend()) == [1, 2, 4, 8]


def test_the_torch_backend_is_never_captured_and_says_why(caplog) -> None:
    # Planning a torch step calls .tolist(), a host sync that CUDA forbids during capture.
    config = WorkerConfig(model="unused", max_num_seqs=8)
    with caplog.at_level(logging.INFO, logger="strata.worker.model_runner"):
        assert cuda_graph_sizes(config, TensorParallel(0, 1), CUDA, TorchAttentionBackend()) == []
    assert "no CUDA graphs: the torch attention backend cannot be captured" in caplog.text


def test_nothing_is_captured_off_cuda_or_with_enforce_eager() -> None:
    eager = WorkerConfig(model="unused", max_num_seqs=8, enforce_eager=True)
    assert cuda_graph_sizes(eager, TensorParallel(0, 1), CUDA, TritonAttentionBackend()) == []
    config = WorkerConfig(model="unused", max_num_seqs=8)
    assert cuda_graph_sizes(config, TensorParallel(0, 1), torch.device("cpu"), TritonAttentionBackend()) == []


def _tiny_model(tmp_path, backend):
    tiny_llama_config(num_hidden_layers=1).save_pretrained(tmp_path)  # the interpreter is slow
    return load_model(tmp_path, torch.float32, TensorParallel(0, 1), backend, DEVICE, "dummy")


def _decode_step(runner: PagedRunner, seqs: list[int], tokens: list[int]) -> StepInputs:
    """The next decode step of ``seqs`` as the model runner would flatten it."""
    positions = np.array([runner.num_cached[seq] for seq in seqs], dtype=np.int64)
    width = max(len(runner.block_tables[seq]) for seq in seqs)
    tables = np.array([runner.block_tables[seq] + [0] * (width - len(runner.block_tables[seq])) for seq in seqs], dtype=np.int32)
    blocks = tables[np.arange(len(seqs)), positions // BLOCK_SIZE]
    return StepInputs(
        rows=np.arange(len(seqs)),
        num_scheduled=np.ones(len(seqs), dtype=np.int64),
        token_ids=np.array(tokens, dtype=np.int64),
        positions=positions,
        slot_mapping=blocks.astype(np.int64) * BLOCK_SIZE + positions % BLOCK_SIZE,
        query_start_loc=np.arange(len(seqs) + 1),
        seq_lens=positions + 1,
        block_tables=tables,
        lora_slots=np.full(len(seqs), -1),
    )


def test_steps_with_a_prefill_chunk_or_too_many_rows_run_eagerly(tmp_path) -> None:
    model = _tiny_model(tmp_path, TorchAttentionBackend())
    padded = PaddedDecode(model, [], [1, 2, 4], MAX_MODEL_LEN, BLOCK_SIZE, DEVICE)
    assert padded.size_for(np.ones(3, dtype=np.int64)) == 4
    assert padded.size_for(np.array([1, 5, 1])) is None
    assert padded.size_for(np.ones(5, dtype=np.int64)) is None


@pytest.mark.parametrize("backend", [TorchAttentionBackend, TritonAttentionBackend], ids=["torch", "triton"])
def test_padded_decode_equals_the_unpadded_step_and_padding_writes_no_kv(backend, tmp_path) -> None:
    model = _tiny_model(tmp_path, backend())
    runner = PagedRunner(model, block_size=BLOCK_SIZE)
    prompts = random_prompts([3, 17, 6], model.vocab_size)
    seqs = [runner.add_sequence(len(prompt) + 1) for prompt in prompts]
    runner.step(list(zip(seqs, prompts)))
    step = _decode_step(runner, seqs, [3, 1, 4])
    before = [cache.clone() for cache in runner.kv_caches]

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(DEVICE)

    meta = AttentionMetadata(
        slot_mapping=on_device(step.slot_mapping),
        block_tables=on_device(step.block_tables),
        query_start_loc=on_device(step.query_start_loc.astype(np.int32)),
        seq_lens=on_device(step.seq_lens.astype(np.int32)),
    )
    with torch.inference_mode():
        expected = model(on_device(step.token_ids), on_device(step.positions), runner.kv_caches, meta)
    written = [cache.clone() for cache in runner.kv_caches]
    for cache, saved in zip(runner.kv_caches, before):
        cache.copy_(saved)

    padded = PaddedDecode(model, runner.kv_caches, [1, 2, 4, 8], MAX_MODEL_LEN, BLOCK_SIZE, DEVICE)
    with torch.inference_mode():
        hidden = padded.run(step, padded.size_for(step.num_scheduled))
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    real_slots = on_device(step.slot_mapping)
    untouched = torch.ones(runner.kv_caches[0].shape[1] * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    untouched[real_slots] = False
    for cache, saved, reference in zip(runner.kv_caches, before, written):
        slots, saved_slots = cache.flatten(1, 2), saved.flatten(1, 2)
        torch.testing.assert_close(slots[:, untouched], saved_slots[:, untouched], rtol=0, atol=0)
        torch.testing.assert_close(slots[:, real_slots], reference.flatten(1, 2)[:, real_slots], rtol=1e-5, atol=1e-5)
