"""Prompt logprobs against HF transformers' log-softmax over the same prompt (float32), in
one prefill chunk, across chunks, after a prefix-cache hit, and scoring alone (max_tokens=0)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata import LLM, SamplingParams

PROMPT = (
    "The three most important inventions of the twentieth century are the transistor, the airplane "
    "and the computer, because each of them changed how people work, travel and talk to each other."
)
LOGPROB_TOLERANCE = 1e-3  # float32 engine vs float32 HF, different kernels
# HF runs the converted (dequantized) weights; the engine does too, so that only the kernels
# differ (on the GGUF blocks its int16 activations move a logprob by about 1e-3 more).
ENGINE = {"executor": "uni", "dtype": "float32", "quantization": "none"}
TOP = 3


@pytest.fixture(scope="module")
def reference(default_model_path):
    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    with LLM(**ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def chunked_llm():
    with LLM(**ENGINE, max_num_batched_tokens=16) as engine:
        yield engine


def assert_matches_hf(reference, prompt_token_ids: list[int], prompt_logprobs: list, top: int = TOP) -> None:
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt_token_ids])).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert prompt_logprobs[0] is None, "nothing predicts the first prompt token"
    assert len(prompt_logprobs) == len(prompt_token_ids)
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        assert list(entry)[0] == prompt_token_ids[position], "the prompt's own token comes first"
        assert set(expected[position - 1].topk(top).indices.tolist()) <= set(entry)
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(float(expected[position - 1, token_id]), abs=LOGPROB_TOLERANCE)


def test_prompt_logprobs_match_hf_in_one_prefill_chunk(llm, reference):
    output = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP), use_tqdm=False)[0]
    assert_matches_hf(reference, output.prompt_token_ids, output.prompt_logprobs)
    assert len(output.outputs[0].token_ids) == 2


def test_prompt_logprobs_match_hf_across_prefill_chunks(chunked_llm, reference):
    output = chunked_llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=TOP), use_tqdm=False)[0]
    assert len(output.prompt_token_ids) > 2 * 16, "the prompt spans several chunks"
    assert_matches_hf(reference, output.prompt_token_ids, output.prompt_logprobs)


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(chunked_llm, reference):
    cached = PROMPT + " And yet"
    chunked_llm.generate(cached, SamplingParams(max_tokens=1), use_tqdm=False)
    output = chunked_llm.generate(cached, SamplingParams(max_tokens=1, prompt_logprobs=TOP), use_tqdm=False)[0]
    assert_matches_hf(reference, output.prompt_token_ids, output.prompt_logprobs)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, reference):
    output = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    completion = output.outputs[0]
    assert (completion.token_ids, completion.text, completion.finish_reason) == ([], "", "length")
    assert_matches_hf(reference, output.prompt_token_ids, output.prompt_logprobs, top=0)


def test_n_completions_share_one_scoring_of_their_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=1)
    output = llm.generate(PROMPT, params, use_tqdm=False)[0]
    alone = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(alone.prompt_logprobs)
    for shared, single in zip(output.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
        assert shared == pytest.approx(single, abs=LOGPROB_TOLERANCE)
    assert all(len(completion.token_ids) == 4 for completion in output.outputs)
