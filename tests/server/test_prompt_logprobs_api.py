"""Prompt logprobs over HTTP, as evaluation harnesses ask for them: ``echo`` with ``logprobs``
(and ``max_tokens`` 0 or 1) on /v1/completions in OpenAI's layout, and vLLM's
``prompt_logprobs`` field, checked against HF transformers' log-softmax."""

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server_helpers import running_server
from strata.worker.model_loader import resolve_model_path

PROMPT = "Question: What is the capital of France?\nAnswer: Paris"
TOLERANCE = 1e-3  # float32 server vs float32 HF


@pytest.fixture(scope="module")
def server(log_dir):
    # The converted (dequantized) weights HF runs: only the kernels differ.
    with running_server(log_dir, "--dtype", "float32", "--quantization", "none") as server:
        yield server


@pytest.fixture(scope="module")
def hf_logprobs():
    """Per prompt position from 1: HF's log-softmax row that predicts it."""
    reference = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(reference(torch.tensor([token_ids])).logits[0, :-1].float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return AutoTokenizer.from_pretrained(resolve_model_path(None))(PROMPT)["input_ids"]


def test_echo_with_logprobs_scores_every_prompt_token_then_the_completion(client, model, prompt_ids, hf_logprobs):
    response = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=1, temperature=0)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(logprobs.tokens) == len(prompt_ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = hf_logprobs(prompt_ids)
    for position in range(1, len(prompt_ids)):
        assert logprobs.token_logprobs[position] == pytest.approx(
            float(expected[position - 1, prompt_ids[position]]), abs=TOLERANCE
        )
        assert len(logprobs.top_logprobs[position]) in (2, 3)  # the token itself and the top 2
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]


def test_echo_with_max_tokens_zero_returns_the_scored_prompt_alone(client, model, prompt_ids):
    response = client.completions.create(model=model, prompt=prompt_ids, echo=True, logprobs=0, max_tokens=0)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (PROMPT, "length")
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids)
    assert all(value is not None for value in choice.logprobs.token_logprobs[1:])
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 0)


def test_streamed_echo_with_logprobs_equals_the_whole_response(client, model):
    fields = dict(model=model, prompt=[PROMPT, "Once upon a time"], echo=True, logprobs=1, max_tokens=5, temperature=0)
    whole = client.completions.create(**fields)
    streamed: dict[int, dict[str, list]] = {}
    for chunk in client.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            parts = streamed.setdefault(choice.index, {"text": [], "tokens": [], "token_logprobs": [], "text_offset": []})
            parts["text"].append(choice.text)
            if choice.logprobs is not None:
                for name in ("tokens", "token_logprobs", "text_offset"):
                    parts[name] += getattr(choice.logprobs, name)
    for choice in whole.choices:
        parts = streamed[choice.index]
        assert "".join(parts["text"]) == choice.text
        assert parts["tokens"] == choice.logprobs.tokens
        # The two calls' steps may batch the rows differently, and float32 sums then run in an
        # order that depends on the rows: 7e-7 seen on EPYC, 1.2e-5 on Xeon-AVX512 (float32 model).
        assert parts["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)
        assert parts["text_offset"] == choice.logprobs.text_offset


def test_prompt_logprobs_field_gives_vllm_shape_on_completions_and_chat(client, model, prompt_ids, hf_logprobs):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
    entries = response.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    expected = hf_logprobs(prompt_ids)
    for position in range(1, len(prompt_ids)):
        own = entries[position][str(prompt_ids[position])]
        assert own["logprob"] == pytest.approx(float(expected[position - 1, prompt_ids[position]]), abs=TOLERANCE)
        assert isinstance(own["decoded_token"], str)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(entry) == 1 for entry in chat_entries[1:])


def test_prompt_logprobs_field_with_stream_is_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
    assert raised.value.body["param"] == "prompt_logprobs"
