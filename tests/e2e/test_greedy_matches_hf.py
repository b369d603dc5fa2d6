"""The engine's greedy tokens equal HF transformers' ``generate`` on the same weights (float32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from strata import LLM, SamplingParams

from conftest import save_tiny_model_with_tokenizer
from model_factory import TINY_CONFIGS, hf_greedy, random_prompts

NEW_TOKENS = 32
LOGPROB_TOLERANCE = 1e-3  # float32 engine vs float32 HF, different kernels
TEXT = (
    "The history of computing is a story of layers: transistors became gates, gates became "
    "processors, processors ran operating systems, and operating systems ran the programs "
    "people actually cared about. Each layer hid the one below it. "
)


def default_model_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from 3 to about 300 tokens, plain text and chat-formatted."""
    chat = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": TEXT * 3 + " Summarise this."}],
    ]
    texts = ["Hello", "def fibonacci(n):", TEXT, TEXT * 5, "1, 2, 3, 4,"]
    texts += [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chat]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def cut_after_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_default_model_greedy_tokens_equal_hf_generate(default_model_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = default_model_prompts(tokenizer)
    llm = LLM(executor="uni", dtype="float32")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    finally:
        llm.shutdown()
    reference = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        expected = cut_after_eos(hf_greedy(reference, prompt, NEW_TOKENS), tokenizer.eos_token_id)
        assert output.outputs[0].token_ids == expected


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_tiny_random_model_greedy_tokens_and_logprobs_equal_hf(kind, tmp_path, default_model_path):
    reference = save_tiny_model_with_tokenizer(kind, tmp_path, default_model_path)
    prompts = random_prompts([5, 17, 33, 70], vocab_size=97)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(tmp_path), executor="uni", dtype="float32") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert entry[token] == pytest.approx(float(expected[step, token]), abs=LOGPROB_TOLERANCE)
