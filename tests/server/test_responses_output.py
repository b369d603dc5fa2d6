"""How a Responses API output is built from a choice's parsed text, without a server: the
items in order, each opened, filled and closed with its events, whitespace that would only
make an empty message held back, and a cut output's last item marked incomplete."""

import itertools

from strata.launch.server.responses import OutputItems
from strata.launch.server.streams import ParsedChoice
from strata.launch.server.tool_parsers import CallDelta


def header(index: int, name: str) -> CallDelta:
    return CallDelta(index, id=f"call_{index}", name=name)


def build(*pieces: ParsedChoice, status: str = "completed") -> tuple[OutputItems, list]:
    items = OutputItems(itertools.count())
    events = [event for piece in pieces for event in items.add(piece)] + items.close(status)
    return items, events


def test_reasoning_then_text_become_two_items_each_closed_before_the_next_opens():
    items, events = build(ParsedChoice(reasoning="Hmm"), ParsedChoice(reasoning=", yes"), ParsedChoice(content="Paris"))
    assert [item.type for item in items.output] == ["reasoning", "message"]
    assert items.output[0].content[0].text == "Hmm, yes" and items.output[1].content[0].text == "Paris"
    assert [event.type for event in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_an_item_announced_as_added_is_sent_as_it_was_then():
    _, events = build(ParsedChoice(content="Paris"))
    added = events[0]
    assert added.type == "response.output_item.added"
    assert added.item.status == "in_progress" and added.item.content == []


def test_whitespace_before_a_call_makes_no_message():
    call = ParsedChoice(tool_calls=[header(0, "get_weather"), CallDelta(0, arguments='{"city": "Paris"}')])
    items, events = build(ParsedChoice(content="\n"), call)
    [item] = items.output
    assert item.type == "function_call" and item.arguments == '{"city": "Paris"}' and item.status == "completed"
    assert "response.output_text.delta" not in [event.type for event in events]
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert (done.name, done.arguments) == ("get_weather", '{"city": "Paris"}')


def test_text_before_calls_is_its_own_message_and_each_call_its_own_item():
    calls = [header(0, "a"), CallDelta(0, arguments="{}"), header(1, "b"), CallDelta(1, arguments="{}")]
    items, _ = build(ParsedChoice(content="Let me check."), ParsedChoice(tool_calls=calls))
    assert [(item.type, getattr(item, "name", None)) for item in items.output] == [
        ("message", None), ("function_call", "a"), ("function_call", "b")
    ]


def test_whitespace_that_leads_into_text_is_kept():
    items, _ = build(ParsedChoice(content=" "), ParsedChoice(content="\n"), ParsedChoice(content="Paris"))
    assert items.output[0].content[0].text == " \nParis"


def test_an_output_with_nothing_in_it_is_one_empty_message():
    items, events = build()
    [message] = items.output
    assert message.type == "message" and message.content[0].text == ""
    assert events[-1].type == "response.output_item.done"


def test_a_cut_output_marks_only_its_last_item_incomplete():
    items, _ = build(ParsedChoice(reasoning="Hmm"), ParsedChoice(content="Par"), status="incomplete")
    assert [item.status for item in items.output] == ["completed", "incomplete"]
