"""The tool-call parsers on fixed text: whole, and fed in pieces as a stream would feed them,
which must give the same calls, each header before its arguments."""

import json

import pytest

from strata.launch.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    ParsedDelta,
    RequiredCallsParser,
    ToolCallParser,
    collect,
)

HERMES_TWO_CALLS = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}"}]}}\n'
    '</tool_call>\n<tool_call>{"arguments": {"q": "a \\"quoted\\" <tool_call>"}, "name": "search"}</tool_call>'
)
LLAMA3_TWO_CALLS = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now", "parameters": {}}'


def fed(parser: ToolCallParser, text: str, piece: int) -> list[ParsedDelta]:
    deltas = [parser.feed(text[start : start + piece]) for start in range(0, len(text), piece)]
    return deltas + [parser.finish()]


def parse(parser: ToolCallParser, text: str, piece: int) -> tuple[str, list[tuple[str, dict]]]:
    merged = ParsedDelta()
    for delta in fed(parser, text, piece):
        merged.extend(delta)
    content, calls = collect(merged)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_hermes_reads_the_calls_and_the_content_around_them_however_the_text_is_split(piece):
    content, calls = parse(HermesParser(), HERMES_TWO_CALLS, piece)
    assert content.strip() == "Let me check."
    assert calls == [
        ("get_weather", {"city": "Paris", "days": [1, {"x": "}"}]}),
        ("search", {"q": 'a "quoted" <tool_call>'}),
    ]


def test_hermes_streams_each_header_before_its_arguments_in_fragments():
    deltas = [call for delta in fed(HermesParser(), HERMES_TWO_CALLS, 3) for call in delta.tool_calls]
    headers = [delta for delta in deltas if delta.id is not None]
    assert [(header.index, header.name) for header in headers] == [(0, "get_weather"), (1, "search")]
    assert all(header.id.startswith("call_") and not header.arguments for header in headers)
    first_fragments = [delta for delta in deltas if delta.index == 0 and delta.id is None]
    assert len(first_fragments) > 3  # sent as the text came, not at the end
    assert deltas.index(headers[0]) < deltas.index(first_fragments[0])


def test_hermes_gives_a_block_that_is_not_a_call_back_as_content():
    content, calls = parse(HermesParser(), "a <tool_call>not json</tool_call> b", 4)
    assert calls == [] and content == "a <tool_call>not json</tool_call> b"


def test_hermes_holds_back_a_possible_tag_start_until_it_is_not_one():
    parser = HermesParser()
    assert parser.feed("hello <tool_").content == "hello "
    assert parser.feed("box>").content == "<tool_box>"


def test_hermes_call_without_arguments_gets_an_empty_object():
    assert parse(HermesParser(), '<tool_call>{"name": "now"}</tool_call>', 3)[1] == [("now", {})]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_llama3_json_reads_semicolon_separated_calls_after_the_python_tag(piece):
    content, calls = parse(Llama3JsonParser(), LLAMA3_TWO_CALLS, piece)
    assert content == ""
    assert calls == [("get_weather", {"city": "Oslo"}), ("now", {})]


@pytest.mark.parametrize("text", ["The weather is fine.", '{"nam": 1} is not a call', '  {"name": "cut'])
def test_llama3_json_output_that_is_not_a_call_is_content(text):
    assert parse(Llama3JsonParser(), text, 2) == (text, [])


@pytest.mark.parametrize("text", ['[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', '{"name": "a", "arguments": {"x": 1}}'])
def test_required_calls_are_one_object_or_an_array_of_them(text):
    expected = [("a", {"x": 1}), ("b", {})] if text.startswith("[") else [("a", {"x": 1})]
    assert parse(RequiredCallsParser(), text, 3)[1] == expected


def test_a_named_call_is_all_arguments_with_the_header_first():
    deltas = fed(NamedCallParser("get_weather"), '{"city": "Rome"}', 4)
    assert deltas[0].tool_calls[0].name == "get_weather" and deltas[0].tool_calls[0].id.startswith("call_")
    assert parse(NamedCallParser("get_weather"), '{"city": "Rome"}', 4)[1] == [("get_weather", {"city": "Rome"})]
