"""Structured outputs through the official ``openai`` client: every answer parses and obeys its
constraint, whatever the sampling; constraints the engine cannot compile are a 400."""

import json

import jsonschema
import openai
import pytest

from server_helpers import running_server

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["x", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(log_dir):
    with running_server(log_dir) as server:
        yield server


def test_fifty_seeded_json_schema_answers_at_temperature_one_all_validate(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a point as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}},
        n=50, seed=7, temperature=1.0, max_tokens=24,
    )
    assert len(response.choices) == 50
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), POINT)


def test_json_object_streams_one_parseable_object(client, model):
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A JSON object, please."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=48, stream=True,
    )
    pieces, reasons = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    if reasons[-1] == "stop":
        assert isinstance(json.loads("".join(pieces)), dict)
    else:  # out of tokens inside the object: still a prefix of one
        assert reasons[-1] == "length" and "".join(pieces).startswith("{")


def test_regex_constrains_a_completion(client, model):
    response = client.completions.create(
        model=model, prompt="Call me at", max_tokens=16, temperature=1.0, seed=3, n=4,
        extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert len(choice.text) == 9 and choice.text[4] == "-" and choice.text.replace("-", "").strip().isdigit()


def test_choice_picks_one_of_the_strings(client, model):
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky green?"}], max_tokens=8,
        temperature=1.0, seed=1, n=6, extra_body={"guided_choice": ["yes", "no", "maybe so"]},
    )
    assert {choice.message.content for choice in response.choices} <= {"yes", "no", "maybe so"}


def test_lark_grammar_constrains_the_output(client, model):
    grammar = 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[1-9]/'
    response = client.completions.create(
        model=model, prompt="A sum:", max_tokens=12, temperature=0, extra_body={"guided_grammar": grammar},
    )
    text = response.choices[0].text
    assert text.startswith("(") and set(text) <= set("()+123456789")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"guided_regex": "(ab"}, "regex"),
        ({"guided_grammar": "start: nothing_defined"}, "grammar"),
        ({"guided_json": {"type": "objec"}}, "json"),
        ({"guided_choice": []}, "choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_400_and_the_server_keeps_serving(client, model, extra, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, prompt="Hi", max_tokens=4, extra_body=extra)
    assert message in str(raised.value)
    after = client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
    assert after.choices[0].finish_reason == "length"


def test_logit_bias_forces_a_token(client, model):
    token = 28  # any id: +100 makes it the argmax at every step
    response = client.completions.create(
        model=model, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(token): 100}, logprobs=0,
    )
    assert len(response.choices[0].logprobs.tokens) == 3
    assert len(set(response.choices[0].logprobs.tokens)) == 1
