"""Tool calling through the official ``openai`` client on the default model: forced calls
(``required``, a named function) are valid calls of the given tools, streamed or not; ``auto``
reads the model's ``<tool_call>`` blocks; a tool result goes back to the model."""

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from server_helpers import running_server
from strata.launch.server.protocol import ChatCompletionRequest
from strata.launch.server.tool_calls import template_messages, tool_plan
from strata.worker.model_loader import resolve_model_path

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_AUTO_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(log_dir):
    with running_server(log_dir) as server:
        yield server


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(chunks) -> tuple[list[dict], str | None, str]:
    """The calls a stream's tool_calls deltas add up to, its last finish_reason and content."""
    calls: list[dict] = []
    finish_reason, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:  # a call's first delta: id, type and name
                    assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return calls, finish_reason, content


def test_required_returns_one_valid_call_of_the_tools(client, model):
    response = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=40, temperature=1.0, seed=4, n=4,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1 and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)


def test_required_streams_valid_calls_as_deltas(client, model):
    chunks = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0, stream=True,
    )
    calls, finish_reason, content = streamed_calls(chunks)
    assert finish_reason == "tool_calls" and content == ""
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_the_call_returned(client, model, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=20, temperature=0, stream=stream,
    )
    if stream:
        calls, finish_reason, _ = streamed_calls(response)
        assert [call["name"] for call in calls] == ["get_time"] and finish_reason == "tool_calls"
        jsonschema.validate(json.loads(calls[0]["arguments"]), CLOCK)
    else:
        message = response.choices[0].message
        assert [call.function.name for call in message.tool_calls] == ["get_time"]
        assert_valid_calls(message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_hermes_tool_call_out_of_the_output(client, model, stream):
    # The small model rarely calls on its own: a regex makes it write one, which the parser reads.
    response = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0, stream=stream,
        extra_body={"guided_regex": FORCED_AUTO_CALL.replace("{", r"\{").replace("}", r"\}")},
    )
    if stream:
        calls, finish_reason, content = streamed_calls(response)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"timezone": "UTC"})]
    else:
        choice = response.choices[0]
        finish_reason, content = choice.finish_reason, choice.message.content or ""
        assert_valid_calls(choice.message.tool_calls)
    assert finish_reason == "tool_calls" and content.strip() == ""


def test_tool_choice_none_leaves_the_output_as_content(client, model):
    response = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0,
        extra_body={"guided_regex": FORCED_AUTO_CALL.replace("{", r"\{").replace("}", r"\}")},
    )
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content == FORCED_AUTO_CALL
    assert choice.finish_reason == "stop"


def test_a_tool_result_goes_back_to_the_model_for_a_final_answer(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=20, temperature=0,
    ).choices[0].message
    call = first.tool_calls[0]
    conversation = [
        *ASK,
        first.model_dump(exclude_none=True),  # the assistant message as the client received it
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(
        model=model, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0,
    )
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 100  # the preamble and history


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "'fly', which is not among the tools"),
        ({"tools": [{"type": "retrieval", "function": TOOLS[0]["function"]}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools[0].function.parameters"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "defined twice"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "already constrains"),
    ],
)
def test_bad_tools_are_a_400_naming_the_problem(client, model, extra, message):
    body = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**body)
    assert message in str(raised.value)


HISTORY = [
    *ASK,
    {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(None))


def test_a_template_without_tools_gets_a_preamble_and_the_history_as_text(tokenizer):
    body = ChatCompletionRequest.model_validate({"model": "m", "tools": TOOLS, "messages": HISTORY})
    messages, tools = template_messages(body.messages, tool_plan(body, "hermes"), tokenizer)
    assert tools is None  # SmolLM2's template ignores tools
    assert [message["role"] for message in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n12:00\n</tool_response>"


def test_a_template_that_renders_tools_gets_them_and_the_calls_arguments_as_objects():
    knows_tools = AutoTokenizer.from_pretrained(resolve_model_path(None))
    knows_tools.chat_template = (
        "{{ tools | map(attribute='function.name') | join(',') }}|{% for m in messages %}"
        "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.arguments.timezone }}{% endfor %}"
        "{{ m.tool_call_id or '' }};{% endfor %}"
    )
    body = ChatCompletionRequest.model_validate({"model": "m", "tools": TOOLS, "messages": HISTORY})
    messages, tools = template_messages(body.messages, tool_plan(body, "hermes"), knows_tools)
    rendered = knows_tools.apply_chat_template(messages, tools=tools, tokenize=False)
    assert rendered == "get_weather,get_time|user:What is the weather in Paris?;assistant:UTC;tool:12:00call_1;"
