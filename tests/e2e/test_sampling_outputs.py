"""Logprobs against HF's log-softmax, seeded sampling, n > 1, and stop strings."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from strata import LLM, SamplingParams

PROMPT = "The three most important inventions of the twentieth century are"
LOGPROB_TOLERANCE = 1e-3  # float32 engine vs float32 HF, different kernels


@pytest.fixture(scope="module")
def llm():
    # HF's reference runs the converted (dequantized) weights: so does the engine.
    with LLM(executor="uni", dtype="float32", quantization="none") as engine:
        yield engine


def test_logprobs_match_hf_log_softmax(llm, default_model_path):
    output = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0]
    completion = output.outputs[0]
    reference = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    sequence = torch.tensor([output.prompt_token_ids + completion.token_ids])
    with torch.inference_mode():
        logits = reference(sequence).logits[0, len(output.prompt_token_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert list(entry)[0] == token, "the sampled token comes first"
        top = expected[step].topk(3)
        assert len(entry) in (3, 4)  # the sampled token may also be among the top 3
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(float(expected[step, token_id]), abs=LOGPROB_TOLERANCE)
        assert set(top.indices.tolist()) <= set(entry)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, seed=s) for s in range(5)]
    batched = llm.generate(["Hello there", PROMPT, "Once upon a time", "x", "y", "z"], others[:1] + [params] + others[1:],
                           use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    top1 = llm.generate(PROMPT, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, seed=7), use_tqdm=False)[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_n_completions_share_the_prompt_and_differ(llm):
    output = llm.generate(PROMPT + " (list)", SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5), use_tqdm=False)[0]
    texts = [c.text for c in output.outputs]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len(set(texts)) > 1


def test_stop_string_cuts_the_text_exactly(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0].text
    stop = free[12:16]
    assert stop.strip(), "pick a stop string that is really in the text"
    cut = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (free[: free.index(stop)], "stop", stop)
    kept = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=30, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == free[: free.index(stop) + len(stop)]


def test_out_of_vocabulary_prompt_finishes_with_error_and_engine_keeps_serving(llm):
    bad, good = llm.generate([[1, 10**9], PROMPT], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "vocabulary" in bad.outputs[0].error
    assert good.outputs[0].finish_reason == "length"


def test_chat_applies_the_template(llm, default_model_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    messages = [{"role": "user", "content": "Say hi."}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert output.prompt_token_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)


def test_top_k_and_logprobs_beyond_the_vocabulary_are_clamped_not_fatal(llm):
    params = SamplingParams(temperature=1.0, top_k=10**7, logprobs=10**6, max_tokens=1, seed=3)
    (output,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].logprobs[0]) > 40_000, "the whole vocabulary, not a crash"
