"""The reasoning parsers on fixed text, whole and cut into deltas at every position (a tag
split across deltas included), and the grammar that constrains only the answer after the
reasoning, checked token by token with the default model's tokenizer."""

import json

import msgspec
import pytest
from transformers import AutoTokenizer

from strata.engine_core.sampling_params import StructuredOutputsParams
from strata.engine_core.structured_output import StructuredOutputs
from strata.launch.server.reasoning_parsers import ReasoningDelta, ReasoningParser, reasoning_format, tokens_covering
from strata.launch.server.streams import ChoiceParser
from strata.launch.server.tool_parsers import HermesParser, collect
from strata.worker.model_loader import resolve_model_path

QWEN3_OUTPUT = "<think>\nThe user wants the capital. It is <b>Paris</b>.\n</think>\n\nParis is the capital."
DEEPSEEK_OUTPUT = "The user wants the capital.</think>\n\nParis."


def split_at_every_position(parser_factory, text: str) -> list[ReasoningDelta]:
    """The whole split of ``text``, for every cut of it into two deltas and for one character a delta."""
    cuts = [[text[:at], text[at:]] for at in range(len(text) + 1)] + [list(text)]
    splits = []
    for pieces in cuts:
        parser = parser_factory()
        merged = ReasoningDelta()
        for piece in pieces:
            delta = parser.feed(piece)
            merged.reasoning += delta.reasoning
            merged.content += delta.content
        rest = parser.finish()
        splits.append(ReasoningDelta(merged.reasoning + rest.reasoning, merged.content + rest.content))
    return splits


def test_qwen3_splits_the_think_block_from_the_answer_wherever_the_deltas_are_cut():
    splits = split_at_every_position(reasoning_format("qwen3").parser, QWEN3_OUTPUT)
    expected = ReasoningDelta("\nThe user wants the capital. It is <b>Paris</b>.\n", "Paris is the capital.")
    assert all(split == expected for split in splits)


def test_qwen3_output_without_an_opening_think_is_all_content():
    text = "Paris. Not <think>ing</think> here."
    splits = split_at_every_position(reasoning_format("qwen3").parser, text)
    assert all(split == ReasoningDelta("", text) for split in splits)


def test_deepseek_r1_output_starts_inside_the_reasoning_wherever_the_deltas_are_cut():
    splits = split_at_every_position(reasoning_format("deepseek_r1").parser, DEEPSEEK_OUTPUT)
    assert all(split == ReasoningDelta("The user wants the capital.", "Paris.") for split in splits)


def test_deepseek_r1_drops_an_opening_think_the_model_writes_itself():
    splits = split_at_every_position(reasoning_format("deepseek_r1").parser, "<think>Hmm.</think>Paris.")
    assert all(split == ReasoningDelta("Hmm.", "Paris.") for split in splits)


def test_deepseek_r1_output_cut_before_the_end_of_reasoning_is_all_reasoning():
    splits = split_at_every_position(reasoning_format("deepseek_r1").parser, "Still thinking </thi")
    assert all(split == ReasoningDelta("Still thinking </thi", "") for split in splits)


def test_a_held_back_tag_prefix_is_not_sent_until_the_tag_is_decided():
    parser = ReasoningParser(starts_inside=True)
    assert parser.feed("Hmm </th") == ReasoningDelta("Hmm ", "")
    assert parser.feed("ink>") == ReasoningDelta("", "")
    assert parser.feed(" Paris") == ReasoningDelta("", "Paris")


def test_reasoning_chars_count_the_block_with_its_tags():
    parser = reasoning_format("qwen3").parser()
    parser.feed(QWEN3_OUTPUT)
    assert QWEN3_OUTPUT[: parser.reasoning_chars].endswith("</think>")
    assert QWEN3_OUTPUT[parser.reasoning_chars :].strip() == "Paris is the capital."


def test_tool_calls_are_read_from_the_answer_only():
    text = (
        '<think>Maybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>?</think>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    for at in range(len(text) + 1):
        parser = ChoiceParser(reasoning_format("qwen3").parser(), HermesParser())
        parsed = parser.feed(text[:at])
        parsed.extend(parser.feed(text[at:]))
        parsed.extend(parser.finish())
        content, calls = collect(parsed)
        assert parsed.reasoning == 'Maybe <tool_call>{"name": "nope", "arguments": {}}</tool_call>?'
        assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Paris"})]
        assert content == ""


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(None))


@pytest.fixture(scope="module")
def structured(tokenizer):
    grammars = StructuredOutputs(f"{resolve_model_path(None)}/tokenizer.json", len(tokenizer), tokenizer.eos_token_id)
    yield grammars
    grammars.shutdown()


def compiled_matcher(structured: StructuredOutputs, params: StructuredOutputsParams, request_id: str):
    structured.submit(request_id, params)
    structured.wait_for_compile(60)
    ready, failed = structured.take_compiled()
    assert ready == [request_id] and not failed
    return structured.matchers[request_id]


def accepts(matcher, tokenizer, text: str) -> bool:
    """Whether the matcher takes every token of ``text`` and is then complete."""
    return all(matcher.consume_token(token) for token in tokenizer.encode(text)) and matcher.is_accepting()


SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


@pytest.mark.parametrize(
    ("parser", "text", "accepted"),
    [
        ("deepseek_r1", 'Any text, even {"n": "x"} or </thin.</think>\n{"n":1}', True),
        ("deepseek_r1", '{"n":1}', False),  # the reasoning block must end first
        ("deepseek_r1", 'Hmm.</think>{"n":"one"}', False),  # the answer is held to the schema
        ("deepseek_r1", 'Hmm.</think>{"n":1}</think>', False),  # the block ends at the first </think>
        ("qwen3", '{"n":1}', True),  # no reasoning block
        ("qwen3", '<think>free</think>{"n":2}', True),
        ("qwen3", 'free</think>{"n":2}', False),  # a block must open with <think>
    ],
)
def test_the_grammar_leaves_the_reasoning_free_and_holds_the_answer_to_the_constraint(
    structured, tokenizer, parser, text, accepted
):
    params = reasoning_format(parser).constrain(StructuredOutputsParams(json=SCHEMA))
    matcher = compiled_matcher(structured, params, f"{parser}-{text}")
    assert accepts(matcher, tokenizer, text) == accepted


def test_while_reasoning_every_text_token_is_allowed_and_after_it_only_the_answer(structured, tokenizer):
    params = reasoning_format("deepseek_r1").constrain(StructuredOutputsParams(choice=["yes", "no"]))
    request_id = "mask-check"
    matcher = compiled_matcher(structured, params, request_id)
    allowed_while_reasoning = allowed_tokens(structured, request_id)
    special = set(tokenizer.added_tokens_decoder)  # SmolLM2's are all special tokens
    # Tokens that are whole UTF-8 text (not a lone piece of a multi-byte character).
    text_tokens = {t for t in range(len(tokenizer)) if t not in special and "\ufffd" not in tokenizer.decode([t])}
    assert text_tokens <= allowed_while_reasoning
    assert tokenizer.eos_token_id not in allowed_while_reasoning  # the answer must still come
    for token in tokenizer.encode("Let me think.</think>"):
        assert matcher.consume_token(token)
    answers = {tokenizer.decode([token]) for token in allowed_tokens(structured, request_id)}
    assert answers and all(answer.strip() in ("", "y", "ye", "yes", "n", "no") for answer in answers)


def allowed_tokens(structured: StructuredOutputs, request_id: str) -> set[int]:
    words = memoryview(structured.fill_bitmask([(request_id, [])])).cast("i")
    return {token for token in range(structured.vocab_size) if words[token // 32] >> (token % 32) & 1}


def test_tokens_covering_counts_the_tokens_that_write_the_reasoning(tokenizer):
    ids = tokenizer.encode("Hmm, let me see.</think>Paris")
    chars = len("Hmm, let me see.</think>")
    covering = tokens_covering(tokenizer, ids, chars)
    assert tokenizer.decode(ids[:covering]).endswith("</think>")
    assert not tokenizer.decode(ids[: covering - 1]).endswith("</think>")


def test_the_reasoning_markers_cross_to_the_engine_and_are_checked():
    params = reasoning_format("qwen3").constrain(StructuredOutputsParams(json=SCHEMA))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=StructuredOutputsParams) == params
    with pytest.raises(ValueError, match="reasoning_start needs reasoning_end"):
        StructuredOutputsParams(json=SCHEMA, reasoning_start="<think>")
