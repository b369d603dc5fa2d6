"""``--reasoning-parser deepseek_r1`` end to end, on a hand-built model that answers every
chat with `` Let me see</think>Paris`` (``thinking_model.py``): the reasoning comes back apart
from the answer in chat completions, whole and streamed one token a delta (so ``</think>``
arrives in three pieces), and as a ``reasoning`` item of the Responses API; a constraint holds
the answer only, after the reasoning."""

import json

import jsonschema
import pytest

from server_helpers import running_server
from thinking_model import ANSWER, REASONING, save_thinking_model

ASK = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
REASONING_TOKENS = 6  # " Let", " me", " see", "</", "think", ">"


@pytest.fixture(scope="module")
def server(log_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("thinker")
    save_thinking_model(model_dir)
    flags = ("--model", str(model_dir), "--dtype", "float32", "--reasoning-parser", "deepseek_r1")
    with running_server(log_dir, *flags) as server:
        yield server


def test_chat_returns_the_reasoning_apart_from_the_answer(client, model):
    message = client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0).choices[0].message
    assert message.reasoning_content == REASONING
    assert message.content == ANSWER


def test_a_stream_splits_the_reasoning_off_though_the_end_tag_comes_in_pieces(client, model):
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=16, temperature=0, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    reasoning = "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas)
    content = "".join(delta.content or "" for delta in deltas)
    assert (reasoning, content) == (REASONING, ANSWER)
    assert sum(1 for delta in deltas if getattr(delta, "reasoning_content", None)) == 3  # one a token


def test_a_constraint_holds_the_answer_but_not_the_reasoning(client, model):
    # The model would answer Paris: the grammar makes it Rome, and only after </think>.
    message = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=16, temperature=0, extra_body={"guided_choice": ["Rome", "Oslo"]}
    ).choices[0].message
    assert message.reasoning_content == REASONING
    assert message.content in ("Rome", "Oslo")


def test_a_json_schema_answer_follows_the_reasoning(client, model):
    response = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    )
    message = response.choices[0].message
    assert message.reasoning_content == REASONING
    jsonschema.validate(json.loads(message.content), CITY)


def test_a_forced_tool_call_is_read_from_the_answer_after_the_reasoning(client, model):
    tools = [{"type": "function", "function": {"name": "get_city", "parameters": CITY}}]
    message = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=24, temperature=0, tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_city"}},
    ).choices[0].message
    assert message.reasoning_content == REASONING and message.content is None
    [call] = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_a_response_has_a_reasoning_item_then_the_message(client, model):
    response = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=16)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content] == [REASONING]
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_a_streamed_response_sends_the_reasoning_item_before_the_message(client, model):
    with client.responses.stream(model=model, input="What is the capital of France?", max_output_tokens=16) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * 3,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.reasoning_text.delta") == REASONING
    assert [event.output_index for event in events if event.type == "response.output_item.done"] == [0, 1]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
