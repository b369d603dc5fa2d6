"""The official ``openai`` client against ``strata serve``, changing nothing but the base URL."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from server_helpers import running_server
from strata.worker.model_loader import resolve_model_path

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(log_dir):
    # Greedy streamed and whole answers must match token for token: float32, and no prefix
    # cache, so that a repeated prompt is computed exactly as the first time (in bfloat16 a
    # prefix-cache hit can flip a near-tie).
    with running_server(log_dir, "--dtype", "float32", "--no-enable-prefix-caching") as server:
        yield server


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str]]:
    """Text and finish reason per choice index, from a completions or chat stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else choice.delta.content
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def test_models_lists_the_default_models_gguf_name(client):
    [card] = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct.Q4_1"
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_greedy_completion_streams_the_same_text_it_returns(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    texts, reasons = stream_text(
        client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    )
    [choice] = whole.choices
    assert choice.text and texts == {0: choice.text}
    assert reasons == {0: choice.finish_reason}
    assert whole.usage.completion_tokens <= 16 and whole.usage.prompt_tokens == 5


def test_greedy_chat_streams_the_same_message_it_returns(client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, reasons = stream_text(chunks)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert texts == {0: choice.message.content}
    assert reasons == {0: choice.finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_goes_through_the_chat_template(client, model, server):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    templated = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    plain = client.completions.create(model=model, prompt=templated, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage == plain.usage


def test_token_id_prompt_completes_like_its_text(client, model):
    ids = AutoTokenizer.from_pretrained(resolve_model_path(None)).encode(PROMPT, add_special_tokens=False)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_n_2_returns_both_choices_each_with_max_tokens(client, model, stream):
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2, stream=stream,
        stream_options={"include_usage": True} if stream else None, extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = list(response)
        texts, reasons = stream_text(chunks)
        usage = chunks[-1].usage
    else:
        texts = {choice.index: choice.text for choice in response.choices}
        reasons = {choice.index: choice.finish_reason for choice in response.choices}
        usage = response.usage
    assert set(texts) == {0, 1} and all(texts.values())
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_with_n_2_numbers_choices_prompt_major(client, model, stream):
    prompts = [PROMPT, "My favourite colour is", "Once upon a time"]
    seeded = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    response = client.completions.create(
        model=model, prompt=prompts, n=2, stream=stream, stream_options={"include_usage": True} if stream else None,
        **seeded,
    )
    if stream:
        chunks = list(response)
        texts, _ = stream_text(chunks)
        usage = chunks[-1].usage
    else:
        texts = {choice.index: choice.text for choice in response.choices}
        usage = response.usage
    assert set(texts) == set(range(6))
    for number, prompt in enumerate(prompts):  # choice p * n + i is prompt p's i-th, seeded alike
        alone = client.completions.create(model=model, prompt=prompt, n=2, **seeded)
        assert [texts[2 * number], texts[2 * number + 1]] == [choice.text for choice in alone.choices]
    assert usage.completion_tokens == 30


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_each_choice(client, model, stream):
    response = client.completions.create(
        model=model, prompt=[PROMPT, "Once upon"], max_tokens=4, temperature=0, echo=True, stream=stream,
    )
    texts = stream_text(response)[0] if stream else {choice.index: choice.text for choice in response.choices}
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert texts[0] == PROMPT + plain and texts[1].startswith("Once upon") and len(texts[1]) > len("Once upon")


def test_echo_of_token_ids_is_their_text(client, model):
    response = client.completions.create(model=model, prompt=[504, 3458], max_tokens=2, temperature=0, echo=True)
    assert response.choices[0].text.startswith(AutoTokenizer.from_pretrained(resolve_model_path(None)).decode([504, 3458]))


def test_a_streamed_text_holding_unicode_line_separators_keeps_each_event_on_one_line(server, model):
    prompt = "one\u2028two\u2029three\u0085four"
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as response:
        # iter_lines splits as str.splitlines does: at U+2028, U+2029 and U+0085 too.
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(choice["text"] for chunk in chunks for choice in chunk["choices"]).startswith(prompt)


def test_max_completion_tokens_bounds_a_chat_reply(client, model):
    response = client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(client, model):
    first, second = (
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234, extra_body={"top_k": 50}
        )
        for _ in range(2)
    )
    assert first.choices[0].text == second.choices[0].text


def test_completion_logprobs_hold_each_sampled_token_and_its_alternatives(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 3 <= len(top) <= 4  # the top 3 plus the sampled token if it is not among them
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is the likeliest
        assert logprob <= 0


def test_streamed_completion_logprobs_match_the_whole_response(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    chunks = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, stream=True)
    choices = [choice for chunk in chunks for choice in chunk.choices if choice.logprobs]
    streamed = [token for choice in choices for token in choice.logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens


def test_chat_logprobs_list_the_top_alternatives_in_order(client, model):
    response = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode() == entry.token


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text_before_it(client, model, stream):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=stream
    )
    if stream:
        texts, reasons = stream_text(response)
    else:
        texts, reasons = {0: response.choices[0].text}, {0: response.choices[0].finish_reason}
    assert texts[0] == full[: full.index(stop)]
    assert reasons[0] == "stop"


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


def test_out_of_range_parameter_is_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, top_p=5)
    assert raised.value.body["param"] == "top_p" and "top_p must be in (0, 1]" in raised.value.body["message"]


def test_a_refused_request_is_logged_with_its_reason(client, model, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, top_p=7)
    logged = "POST /v1/completions refused with 400 (invalid_request_error): top_p must be in (0, 1]"
    assert logged in server.log.read_text(errors="replace")


def test_prompt_plus_max_tokens_beyond_max_model_len_is_400(client, model):
    with pytest.raises(openai.BadRequestError, match="exceed max_model_len"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="no room to generate"):
        client.completions.create(model=model, prompt=[1] * 9000, max_tokens=1)


@pytest.mark.parametrize("stream", [False, True])
def test_token_the_engine_rejects_is_400_with_its_reason(client, model, stream):
    # A stream answers only once the engine took the request, so this is an HTTP 400 too.
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=model, prompt=[1, 10**9], max_tokens=2, stream=stream)


def test_engine_error_after_a_rejected_request_leaves_the_server_serving(client, model):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[10**9], max_tokens=2)
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


def test_debug_endpoints_are_off_by_default(server):
    assert httpx.get(f"{server.url}/debug/state").status_code == 404


@pytest.mark.parametrize("example", ["openai_chat.py", "openai_streaming.py"])
def test_examples_run_against_the_server(server, example):
    script = Path(__file__).parents[2] / "examples" / example
    result = subprocess.run(
        [sys.executable, str(script), "--base-url", f"{server.url}/v1", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_chat_accepts_platform_fields_that_change_nothing_in_the_answer(client, model):
    given = dict(model=model, messages=CHAT, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**given)
    tagged = client.chat.completions.create(**given, store=True, metadata={"run": "7"}, service_tier="auto", user="u1")
    assert tagged.choices[0].message.content == plain.choices[0].message.content


def test_chat_refuses_reasoning_effort_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, reasoning_effort="high")
    assert refused.value.body["param"] == "reasoning_effort"
