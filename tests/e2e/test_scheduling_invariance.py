"""A prompt's greedy tokens do not depend on how the scheduler runs it: alone or batched,
chunked by a tiny token budget, preempted by a tiny KV pool, with or without prefix caching."""

import pytest
from transformers import AutoTokenizer

from strata import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SHARED = "You are a helpful assistant. Answer briefly and precisely. " * 8  # over a CPU block (64 tokens)


@pytest.fixture(scope="module")
def prompts(default_model_path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    texts = [SHARED + q for q in ["Why is the sky blue?", "Name three primes.", "What is rust?", "Hi"]]
    texts += ["Tell me a story about a dragon who learned to code. " * 3, "2 + 2 ="]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def generate(prompts, **engine_args) -> tuple[list[list[int]], LLM]:
    with LLM(executor="uni", dtype="float32", **engine_args) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def alone(prompts) -> list[list[int]]:
    with LLM(executor="uni", dtype="float32") as llm:
        return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_batched_with_chunked_prefill_equals_alone(prompts, alone):
    tokens, llm = generate(prompts, max_num_batched_tokens=32)
    assert tokens == alone


def test_batched_with_preemption_equals_alone(prompts, alone):
    tokens, llm = generate(prompts, block_size=16, num_gpu_blocks=12, max_num_batched_tokens=64)
    assert llm.stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert tokens == alone


def test_prefix_caching_on_and_off_give_the_same_tokens(prompts, alone):
    cached, llm = generate(prompts, enable_prefix_caching=True)
    assert llm.stats.prefix_cache_hits > 0
    uncached, llm = generate(prompts, enable_prefix_caching=False)
    assert llm.stats.prefix_cache_hits == 0
    assert cached == uncached == alone
