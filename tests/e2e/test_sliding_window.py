"""A sliding-window model (tiny random Gemma 3, 8-token window, 16-token blocks) through the whole
engine in float32 with the default attention backend: greedy tokens equal HF transformers, and
stay the same when prompts longer than the window are prefilled in chunks from prefix-cached
blocks."""

import pytest
from transformers import PreTrainedModel

from strata import LLM, SamplingParams

from conftest import save_tiny_model_with_tokenizer
from model_factory import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
VOCAB = 97


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_path) -> tuple[str, PreTrainedModel]:
    path = tmp_path_factory.mktemp("gemma3")
    return str(path), save_tiny_model_with_tokenizer("gemma3_text", path, default_model_path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Three prompts sharing a 40-token prefix, and one of its own; all longer than the window."""
    (shared,) = random_prompts([40], VOCAB, seed=3)
    tails = random_prompts([30, 9, 57], VOCAB, seed=4)
    return [shared + tail for tail in tails] + random_prompts([83], VOCAB, seed=5)


@pytest.fixture(scope="module")
def whole(model, prompts) -> list[list[int]]:
    """Each prompt prefilled in one step, no prefix caching."""
    with LLM(model[0], executor="uni", dtype="float32", enable_prefix_caching=False) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def test_greedy_tokens_equal_hf(model, prompts, whole):
    assert whole == [hf_greedy(model[1], prompt, GREEDY.max_tokens) for prompt in prompts]


def test_chunked_prefill_from_prefix_cached_blocks_gives_the_same_tokens(model, prompts, whole):
    # 13-token chunks end inside blocks and windows; the later prompts find the first's
    # 32-token prefix (two full blocks of 16) cached, part of it behind their window.
    with LLM(model[0], executor="uni", dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=13,
             block_size=16) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        assert llm.stats.prefix_cache_hits > 0
    assert [output.outputs[0].token_ids for output in first + rest] == whole
