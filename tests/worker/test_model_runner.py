"""The model runner's step on a tiny random model: what a step computes and reports."""

import psutil
import pytest
import torch

from strata.engine_core.protocol import CachedRequestData, NewRequestData, SchedulerOutput, pack_handles, unpack_tokens
from strata.engine_core.sampling_params import SamplingParams
from strata.worker.attention import TorchAttentionBackend, TritonAttentionBackend, kv_cache_dtype
from strata.worker.config import WorkerConfig
from strata.worker.model_runner import ModelRunner
from worker_helpers import SINGLE_RANK

from model_factory import random_prompts, save_tiny_model, tiny_llama_config


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(tiny_llama_config(), path)
    config = WorkerConfig(model=str(path), dtype="float32", num_gpu_blocks=32, max_num_seqs=4, max_model_len=128)
    return ModelRunner(config, SINGLE_RANK)


def test_logprobs_come_only_for_the_chunk_that_ends_the_prompt(runner):
    (prompt,) = random_prompts([40], vocab_size=97)
    params = SamplingParams(temperature=0, logprobs=3, seed=1)
    first = SchedulerOutput(
        step=1,
        new_requests=[NewRequestData("r", 0, prompt, [], params, None, [0, 1, 2], 0, 16)],
        total_num_scheduled_tokens=16,
    )
    assert runner.execute(first).logprobs == {}, "logprobs of a partial prefill chunk"
    rest = SchedulerOutput(
        step=2, cached=CachedRequestData(pack_handles([0]), {0: 24}), total_num_scheduled_tokens=24
    )
    output = runner.execute(rest)
    assert list(output.logprobs) == [0]
    assert [len(entry.token_ids) for entry in output.logprobs[0]] == [1 + 3]


def test_a_kv_cache_beyond_the_machines_memory_is_refused_at_start(tmp_path):
    save_tiny_model(tiny_llama_config(), tmp_path)
    config = WorkerConfig(model=str(tmp_path), dtype="float32", kv_cache_memory=psutil.virtual_memory().total * 2)
    with pytest.raises(ValueError, match="more than the .* GiB of memory available"):
        ModelRunner(config, SINGLE_RANK)


def test_narrower_kv_caches_hold_more_blocks_in_the_same_memory(tmp_path):
    save_tiny_model(tiny_llama_config(), tmp_path)
    runners = [
        ModelRunner(
            WorkerConfig(model=str(tmp_path), dtype="float32", kv_cache_dtype=name, kv_cache_memory=1 << 22), SINGLE_RANK
        )
        for name in ("float32", "bfloat16", "fp8")
    ]
    assert [runner.kv_caches[0].dtype for runner in runners] == [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
    assert [runner.num_blocks / runners[0].num_blocks for runner in runners] == [1, 2, 4]


def test_auto_keeps_the_backends_own_cache_dtype():
    assert kv_cache_dtype(TorchAttentionBackend, torch.bfloat16, "auto", torch.device("cpu")) == torch.float32


def pretend_cuda_capability(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a test GPU")
    return torch.device("cuda:0")


def test_an_fp8_cache_on_the_triton_backend_is_refused_below_compute_capability_8_9(monkeypatch):
    ampere = pretend_cuda_capability(monkeypatch, (8, 0))
    with pytest.raises(ValueError, match="fp8 on the triton attention backend needs .* a test GPU has 8.0"):
        kv_cache_dtype(TritonAttentionBackend, torch.bfloat16, "fp8", ampere)
    assert kv_cache_dtype(TritonAttentionBackend, torch.bfloat16, "float16", ampere) == torch.float16


def test_an_fp8_cache_on_the_triton_backend_is_taken_from_compute_capability_8_9(monkeypatch):
    hopper = pretend_cuda_capability(monkeypatch, (9, 0))
    assert kv_cache_dtype(TritonAttentionBackend, torch.bfloat16, "fp8", hopper) == torch.float8_e4m3fn


def first_token(runner: ModelRunner, prompt: list[int], params: SamplingParams) -> int:
    """The token a request with ``prompt`` samples after its whole prompt, in one step."""
    new = NewRequestData("first", 1, prompt, [], params, None, list(range(8, 16)), 0, len(prompt))
    output = runner.execute(SchedulerOutput(step=1, new_requests=[new], total_num_scheduled_tokens=len(prompt)))
    return unpack_tokens(output.sampled_token_ids)[0]


def test_a_row_below_min_tokens_never_picks_a_stop_token(runner):
    (prompt,) = random_prompts([30], vocab_size=97, seed=3)
    greedy = first_token(runner, prompt, SamplingParams(temperature=0))
    held = first_token(runner, prompt, SamplingParams(temperature=0, stop_token_ids=[greedy], min_tokens=1))
    assert held != greedy


def test_a_logit_bias_reaches_the_greedy_pick(runner):
    (prompt,) = random_prompts([30], vocab_size=97, seed=3)
    greedy = first_token(runner, prompt, SamplingParams(temperature=0))
    favoured = (greedy + 1) % 97
    assert first_token(runner, prompt, SamplingParams(temperature=0, logit_bias={favoured: 100.0})) == favoured


def test_a_repetition_penalty_turns_the_greedy_pick_away_from_the_prompts_tokens(runner):
    # The prompt holds most of the vocabulary, the unpenalised pick among them.
    prompt = list(range(90))
    assert first_token(runner, prompt, SamplingParams(temperature=0)) in prompt
    assert first_token(runner, prompt, SamplingParams(temperature=0, repetition_penalty=1e6)) not in prompt
