"""Pipeline parallelism over worker processes (gloo): two stages give one rank's greedy tokens,
with the CPU offload tier, n-gram drafts and grammars on; two stages of two TP ranks give HF's;
a killed stage fails the requests and ends the engine cleanly."""

import os
import signal
import threading
import time

import psutil
import pytest

from strata import LLM, SamplingParams
from strata.engine_core.sampling_params import StructuredOutputsParams
from strata.runtime.core_client import EngineDeadError

from model_factory import hf_greedy, random_prompts, save_tiny_model, tiny_llama_config

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
VOCAB = 97  # prompts draw from the first ids only
# The options both engines of the shared pair run with: a cache of 14 blocks of 16 (224 tokens)
# that a 180-token document and its reverse cannot share, so the document's blocks go to the CPU tier.
SHARED_OPTIONS = dict(
    dtype="float32", block_size=16, num_gpu_blocks=14, kv_offload_cpu_bytes=64 * 1024 * 1024,
    speculative_method="ngram", num_speculative_tokens=3,
)
CHOICES = ["The capital of France is Paris", "I do not know"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_path):
    """A 4-layer Llama with the default model's tokenizer (and vocabulary), so grammars compile."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-llama-4-layers")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    config = tiny_llama_config(num_hidden_layers=4, num_key_value_heads=4, vocab_size=len(tokenizer))
    reference = save_tiny_model(config, path)
    tokenizer.save_pretrained(path)
    return path, reference


@pytest.fixture(scope="module")
def engines(tiny_model):
    """Two pipeline stages on worker processes, and one rank in this process, alike otherwise."""
    path, _ = tiny_model
    with LLM(str(path), executor="mp", pipeline_parallel_size=2, **SHARED_OPTIONS) as pipelined:
        with LLM(str(path), executor="uni", **SHARED_OPTIONS) as single:
            yield pipelined, single


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_pp2_greedy_tokens_equal_one_rank_and_hf(engines, tiny_model):
    pipelined, single = engines
    prompts = random_prompts([9, 30, 50], vocab_size=VOCAB)  # they fit the cache together: no preemption
    tokens = token_ids(pipelined, prompts)
    assert tokens == token_ids(single, prompts)
    assert tokens[0] == hf_greedy(tiny_model[1], prompts[0], GREEDY.max_tokens)


def test_pp2_reloads_an_evicted_prefix_from_the_cpu_tier_with_the_same_tokens(engines):
    pipelined, single = engines
    document = random_prompts([180], vocab_size=VOCAB, seed=1)[0]
    # Alternating with the reversed document evicts the document's blocks from the device cache.
    sequence = [document + [1], document[::-1], document + [2], document[::-1], document + [3]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [token_ids(pipelined, [prompt], params)[0] for prompt in sequence]
    assert pipelined.stats.offload_hit_tokens > 0
    assert tokens == [token_ids(single, [prompt], params)[0] for prompt in sequence]


def test_pp2_verifies_ngram_drafts_and_keeps_one_ranks_tokens(engines):
    pipelined, single = engines
    repetitive = [[5, 6, 7, 8, 9] * 8, [20, 21, 22] * 12]
    tokens = token_ids(pipelined, repetitive)
    assert pipelined.stats.spec_accepted_tokens > 0  # rows gained several tokens in a step
    assert tokens == token_ids(single, repetitive)


def test_pp2_constrained_choice_equals_one_rank(engines):
    pipelined, single = engines
    choice = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    prompts = ["Answer:", "What is the capital of France?"]
    texts = [o.outputs[0].text for o in pipelined.generate(prompts, choice, use_tqdm=False)]
    assert set(texts) <= set(CHOICES)
    assert texts == [o.outputs[0].text for o in single.generate(prompts, choice, use_tqdm=False)]


def test_pp2_tp2_on_four_ranks_with_an_uneven_split_equals_hf(tiny_model):
    path, reference = tiny_model
    prompts = random_prompts([9, 30, 50], vocab_size=VOCAB)
    with LLM(str(path), executor="mp", dtype="float32", pipeline_parallel_size=2, tensor_parallel_size=2,
             pipeline_layer_partition=[1, 3]) as pipelined:
        tokens = token_ids(pipelined, prompts)
    assert tokens == [hf_greedy(reference, prompt, GREEDY.max_tokens) for prompt in prompts]


def test_killed_stage_fails_requests_naming_its_rank_and_ends_the_engine(tiny_model):
    path, _ = tiny_model
    llm = LLM(str(path), executor="mp", dtype="float32", pipeline_parallel_size=2, worker_timeout_s=30)
    try:
        engine_core = psutil.Process(llm.engine.process.pid)
        workers = [p.pid for p in engine_core.children() if "strata.worker.worker_process" in " ".join(p.cmdline())]
        threading.Timer(1.0, os.kill, (workers[1], signal.SIGKILL)).start()
        started = time.monotonic()
        # Long enough that the kill lands mid-generation: 200 tokens for each of 32 requests.
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        outputs = llm.generate(random_prompts([20] * 32, vocab_size=VOCAB), long, use_tqdm=False)
        assert time.monotonic() - started < 1.0 + 10
        for output in outputs:
            assert output.outputs[0].finish_reason == "error"
            assert "rank 1" in output.outputs[0].error
        with pytest.raises(EngineDeadError):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
