"""``POST /v1/responses`` through the official ``openai`` client's ``responses`` API on the
default model: whole and streamed responses, a function-tool round trip, structured output,
and the fields that are refused with a 400 naming them."""

import json

import httpx
import jsonschema
import openai
import pytest

from server_helpers import running_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
QUESTION = "What is the weather in Paris?"
# Greedy: sampled, a reply can end on its own before its third token (1 in 6,000 did).
CUT_AT_3 = {"input": "Tell me a long story.", "max_output_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(log_dir):
    with running_server(log_dir) as server:
        yield server


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=300)


def test_a_response_answers_a_text_input(client, model):
    response = client.responses.create(
        model=model, input="What is the capital of France?", max_output_tokens=24, temperature=0
    )
    assert response.status == "completed" and response.id.startswith("resp_")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.output_text.strip()
    usage = response.usage
    assert 0 < usage.output_tokens <= 24 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_and_input_are_the_chat_prompt(client, model, server):
    given = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    response = client.responses.create(model=model, instructions="Answer in French.", input=given, max_output_tokens=4)
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert response.usage.input_tokens == prompt["count"]
    assert response.instructions == "Answer in French."


def test_a_stream_sends_typed_events_in_order_that_add_up_to_the_response(client, model):
    with client.responses.stream(model=model, input="Name a color.", max_output_tokens=200, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"
    ]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == final.output_text
    assert final.output_text and final.usage.output_tokens > 0


def test_a_response_cut_by_max_output_tokens_is_incomplete(client, model):
    response = client.responses.create(model=model, **CUT_AT_3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(client, model):
    with client.responses.stream(model=model, **CUT_AT_3) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    done = next(event for event in events if event.type == "response.output_item.done")
    assert done.item.status == "incomplete"


def test_a_forced_function_call_then_its_output_gets_a_message(client, model):
    first = client.responses.create(
        model=model, input=QUESTION, tools=TOOLS, tool_choice="required", max_output_tokens=40, temperature=0
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True)]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "It is 21 degrees and sunny."}
    second = client.responses.create(
        model=model, input=[*history, result], tools=TOOLS, max_output_tokens=24, temperature=0
    )
    assert [item.type for item in second.output] == ["message"] and second.output_text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt


def test_a_named_function_streams_its_arguments(client, model):
    with client.responses.stream(
        model=model, input=QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    ) as stream:
        events = list(stream)
    added = next(event for event in events if event.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    fragments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert done.arguments == fragments and done.name == "get_weather"
    jsonschema.validate(json.loads(fragments), WEATHER)
    assert events[-1].type == "response.completed"


def test_parallel_tool_calls_false_gives_one_call(client, model):
    response = client.responses.create(
        model=model, input=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=40, temperature=1.0, extra_body={"seed": 3},
    )
    assert [item.type for item in response.output] == ["function_call"]
    assert response.parallel_tool_calls is False


def test_text_format_json_schema_constrains_the_answer(client, model):
    schema = {
        "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model, input="What is 2 + 2?", max_output_tokens=24, temperature=0,
        text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_fields_that_change_nothing_in_the_answer_are_accepted(client, model):
    response = client.responses.create(
        model=model, input="Hi", max_output_tokens=2, temperature=0, store=True, metadata={"run": "7"}, user="u1",
        service_tier="auto", include=[], safety_identifier="s1", prompt_cache_key="k",
    )
    assert response.status == "incomplete" and response.metadata == {"run": "7"}
    assert response.store is False  # accepted, not stored


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, model, extra, param):
    response = post(server, {"model": model, "input": "Hi", **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]},
        {"type": "item_reference", "id": "msg_1"},
        {"type": "function_call_output", "call_id": "call_nobody_made", "output": "42"},
    ],
)
def test_input_items_that_cannot_be_served_are_a_400_naming_input(server, model, item):
    response = post(server, {"model": model, "input": [{"role": "user", "content": "Hi"}, item]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input"


def test_another_models_name_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
