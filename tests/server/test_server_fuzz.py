"""Hostile request bodies: every one gets a 4xx with an OpenAI error body, and the server
keeps serving. Each strategy builds bodies that are invalid by construction."""

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_helpers import running_server
from strata.launch.server.protocol import SamplingFields

MODEL = "fuzz-model"
MAX_REQUEST_BYTES = 65536
MAX_MODEL_LEN = 512
VOCAB_SIZE = 49152
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
RESPONSE = {"model": MODEL, "input": "Hello", "max_output_tokens": 2}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- JSON values, and values of the wrong type or out of range for a field ----

finite_floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | st.integers() | finite_floats | st.text(max_size=12)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


not_a_number = json_values.filter(lambda v: v is not None and not is_number(v))
not_an_int = json_values.filter(lambda v: v is not None and not is_int(v))
not_a_bool = json_values.filter(lambda v: v is not None and not isinstance(v, bool))
not_a_string = json_values.filter(lambda v: v is not None and not isinstance(v, str))


def below(bound: float) -> st.SearchStrategy:
    """Finite numbers, floats or (possibly huge) integers, strictly below ``bound``."""
    floats = st.floats(max_value=bound, allow_nan=False, allow_infinity=False).filter(lambda v: v < bound)
    return floats | st.integers(max_value=math.ceil(bound) - 1)


def above(bound: float) -> st.SearchStrategy:
    floats = st.floats(min_value=bound, allow_nan=False, allow_infinity=False).filter(lambda v: v > bound)
    return floats | st.integers(min_value=math.floor(bound) + 1)


def ints_outside(low: int, high: int) -> st.SearchStrategy:
    return st.integers(max_value=low - 1) | st.integers(min_value=high + 1)


zeros = st.sampled_from([0, 0.0, -0.0])
SHARED_BAD_VALUES = {
    "model": json_values.filter(lambda v: v != MODEL),  # wrong type: 400; another name: 404
    # Above max_model_len minus the shortest prompt: too long for every base body.
    "max_tokens": not_an_int | ints_outside(1, MAX_MODEL_LEN - 1),
    "temperature": not_a_number | below(0),
    "top_p": not_a_number | below(0) | zeros | above(1),
    "top_k": not_an_int | st.just(0) | st.integers(max_value=-2),
    "min_p": not_a_number | below(0) | above(1),
    "n": not_an_int | ints_outside(1, 128),
    "seed": not_an_int | ints_outside(-(2**63), 2**63 - 1),
    "stop": json_values.filter(lambda v: v is not None and not isinstance(v, str | list))
    | st.lists(not_a_string, min_size=1, max_size=3) | st.just("") | st.just(["a", ""])
    | st.lists(st.text(min_size=1), min_size=5, max_size=8),  # OpenAI allows 4
    "logit_bias": json_values.filter(lambda v: v is not None and not isinstance(v, dict))
    | st.dictionaries(st.integers(0, 100).map(str), below(-100) | above(100), min_size=1, max_size=3)
    | st.dictionaries(st.text().filter(lambda k: not (k.isascii() and k.isdigit())), st.integers(-100, 100), min_size=1, max_size=3)
    | st.just({str(i): 1 for i in range(301)})
    | st.just({str(VOCAB_SIZE): 1}),  # outside the vocabulary: refused by the EngineCore
    "priority": not_an_int,
    "response_format": json_values.filter(lambda v: v is not None and not isinstance(v, dict))
    | st.fixed_dictionaries({"type": st.text().filter(lambda t: t not in ("text", "json_object", "json_schema"))})
    | st.just({"type": "json_schema"}) | st.just({"type": "json_schema", "json_schema": {"name": "x"}}),
    "guided_choice": st.just([]) | st.just([""]) | json_values.filter(lambda v: v is not None and not isinstance(v, list)),
    "guided_regex": st.sampled_from(["(", "[a-", "a{2,1}", "(?<"]),
    "guided_json": json_values.filter(lambda v: v is not None and not isinstance(v, dict))
    | st.just({"type": "objec"}) | st.just({"$ref": "#/nowhere"}),
    "presence_penalty": not_a_number | below(-2) | above(2),
    "frequency_penalty": not_a_number | below(-2) | above(2),
    "repetition_penalty": not_a_number | below(0) | zeros,
    "min_tokens": not_an_int | st.integers(max_value=-1) | st.integers(min_value=3),  # above max_tokens (2)
    "stream": not_a_bool,
    "stream_options": json_values.filter(lambda v: v is not None and not isinstance(v, dict))
    | st.fixed_dictionaries({"include_usage": not_a_bool}) | st.just({"unknown": True}),
    "ignore_eos": not_a_bool,
    "user": not_a_string,
    "cache_salt": not_a_string | st.just("") | st.text(min_size=257, max_size=300),
}
COMPLETION_BAD_VALUES = {
    **SHARED_BAD_VALUES,
    "prompt": st.sampled_from(["", [], [""], [[]]])  # empty
    | json_values.filter(lambda v: not isinstance(v, str | list))
    | st.lists(st.integers(max_value=-1) | st.integers(min_value=VOCAB_SIZE), min_size=1, max_size=4)
    | st.just(["a"] * 129) | st.just(["a", ""])  # too many prompts; an empty one
    | st.lists(st.floats(allow_nan=False) | st.booleans() | st.dictionaries(st.text(), scalars), min_size=1),
    "logprobs": not_an_int | ints_outside(0, 20),
    "echo": not_a_bool,
}
ROLES = ("system", "developer", "user", "assistant", "tool")
bad_content = not_a_string.filter(lambda v: not isinstance(v, list))
bad_messages = (
    st.just([])
    | json_values.filter(lambda v: not isinstance(v, list))
    | st.lists(
        st.fixed_dictionaries({"role": st.text().filter(lambda r: r not in ROLES), "content": st.text()})
        | st.fixed_dictionaries({"role": st.just("user"), "content": bad_content})
        | st.fixed_dictionaries({"content": st.text()})  # no role
        | st.fixed_dictionaries({"role": st.just("user"), "content": st.just([{"type": "image_url", "url": "x"}])})
        | st.fixed_dictionaries({"role": st.just("tool"), "content": st.text()})  # answers no call
        | st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": json_values.filter(lambda v: v is not None)})
        | not_a_string.filter(lambda v: not isinstance(v, dict)),
        min_size=1, max_size=3,
    )
)
CHAT_BAD_VALUES = {
    **SHARED_BAD_VALUES,
    "messages": bad_messages,
    "max_completion_tokens": not_an_int | ints_outside(1, MAX_MODEL_LEN - 1),
    "logprobs": not_a_bool,
    "top_logprobs": not_an_int | ints_outside(0, 20),
    # Random keys are at most 6 characters: never a tool's "function".
    "tools": json_values.filter(lambda v: v is not None and not isinstance(v, list))
    | st.lists(json_values, min_size=1, max_size=3) | st.just([TOOL] * 129),
    "tool_choice": st.text().filter(lambda t: t != "none") | st.just({"type": "function", "function": {"name": "nope"}})
    | json_values.filter(lambda v: v is not None and not isinstance(v, str)),
    "parallel_tool_calls": not_a_bool,
    "store": not_a_bool,
    "metadata": json_values.filter(lambda v: v is not None and not isinstance(v, dict))
    | st.dictionaries(st.text(max_size=6), not_a_string, min_size=1, max_size=3)
    | st.just({str(i): "x" for i in range(17)}),  # OpenAI allows 16 pairs
    "service_tier": st.text().filter(lambda t: t not in ("auto", "default", "flex", "scale", "priority")),
}
bad_input_items = st.lists(
    st.fixed_dictionaries({"role": st.text().filter(lambda r: r not in ROLES), "content": st.text()})
    | st.fixed_dictionaries({"role": st.just("user"), "content": bad_content})
    | st.fixed_dictionaries({"role": st.just("user"), "content": st.just([{"type": "input_image", "image_url": "x"}])})
    | st.fixed_dictionaries({"type": st.text().filter(lambda t: t not in ("message", "reasoning")), "role": st.just("user")})
    | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(), "output": st.text()})
    | st.just({"type": "function_call", "call_id": "c", "name": "f", "arguments": "["})  # not an object
    | not_a_string.filter(lambda v: not isinstance(v, dict)),
    min_size=1, max_size=3,
)
RESPONSES_BAD_VALUES = {
    **{field: values for field, values in SHARED_BAD_VALUES.items() if field in SamplingFields.model_fields},
    "model": SHARED_BAD_VALUES["model"],
    "stream": not_a_bool,
    "input": st.just([]) | json_values.filter(lambda v: not isinstance(v, str | list)) | bad_input_items,
    "instructions": not_a_string,
    "max_output_tokens": not_an_int | ints_outside(1, MAX_MODEL_LEN - 1),
    "tools": json_values.filter(lambda v: v is not None and not isinstance(v, list))
    | st.lists(json_values, min_size=1, max_size=3) | st.just([{"type": "web_search"}]),
    "tool_choice": st.text().filter(lambda t: t != "none") | st.just({"type": "function", "name": "nope"})
    | json_values.filter(lambda v: v is not None and not isinstance(v, str)),
    "text": json_values.filter(lambda v: v is not None and not isinstance(v, dict))
    | st.text().filter(lambda t: t not in ("text", "json_object")).map(lambda kind: {"format": {"type": kind}})
    | st.just({"format": {"type": "json_schema", "name": "x"}}),
    "previous_response_id": st.text(),
    "truncation": st.text().filter(lambda t: t != "disabled"),
    "reasoning": st.fixed_dictionaries({"effort": st.text()}),
    "background": st.just(True),
    "top_logprobs": st.integers(min_value=1) | not_an_int,
    "store": CHAT_BAD_VALUES["store"],
    "metadata": CHAT_BAD_VALUES["metadata"],
}
ENDPOINTS = {
    "/v1/completions": (COMPLETION, COMPLETION_BAD_VALUES),
    "/v1/chat/completions": (CHAT, CHAT_BAD_VALUES),
    "/v1/responses": (RESPONSE, RESPONSES_BAD_VALUES),
}
REQUIRED = {
    "/v1/completions": ["model", "prompt"], "/v1/chat/completions": ["model", "messages"], "/v1/responses": ["model", "input"]
}
KNOWN_FIELDS = set(COMPLETION_BAD_VALUES) | set(CHAT_BAD_VALUES) | set(RESPONSES_BAD_VALUES)


def nested_schema(depth: int) -> dict:
    """An object schema whose only property nests ``depth`` levels deep."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@st.composite
def one_bad_field(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, bad_values = ENDPOINTS[path]
    field = draw(st.sampled_from(sorted(bad_values)))
    return path, json.dumps({**base, field: draw(bad_values[field])}).encode()


@st.composite
def structurally_wrong(draw) -> tuple[str, bytes]:
    """Not an object; a required field missing; an unknown field; nesting too deep."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, _ = ENDPOINTS[path]
    kind = draw(st.sampled_from(["not an object", "missing", "unknown field", "deep"]))
    if kind == "not an object":
        body = draw(json_values.filter(lambda v: not isinstance(v, dict)))
    elif kind == "missing":
        missing = draw(st.sampled_from(REQUIRED[path]))
        body = {key: value for key, value in base.items() if key != missing}
    elif kind == "unknown field":
        unknown = draw(st.text(min_size=1, max_size=12).filter(lambda key: key not in KNOWN_FIELDS))
        body = {**base, unknown: draw(json_values)}
    else:
        depth = draw(st.integers(min_value=2, max_value=20000))
        key = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/v1/responses": "input"}[path]
        return path, json.dumps({**base, key: None}).replace("null", "[" * depth + "]" * depth).encode()
    return path, json.dumps(body).encode()


@st.composite
def broken_bytes(draw) -> tuple[str, bytes]:
    """A valid body, cut short or with bytes that are not UTF-8 in it."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    body = json.dumps(ENDPOINTS[path][0]).encode()
    cut = draw(st.integers(min_value=0, max_value=len(body)))
    if draw(st.booleans()):
        return path, body[: cut - 1] if cut else b""
    invalid = draw(st.sampled_from([b"\xff", b"\xfe", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
    return path, body[:cut] + invalid + body[cut:]


@pytest.fixture(scope="module")
def server(log_dir):
    with running_server(
        log_dir, "--served-model-name", MODEL, "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--max-model-len", str(MAX_MODEL_LEN),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int | None = None) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert status is None or response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and set(error) == {"message", "type", "param", "code"}


@FUZZ
@given(one_bad_field())
def test_a_field_of_the_wrong_type_or_out_of_range_is_a_4xx(http, case):
    path, body = case
    assert_openai_error(http.post(path, content=body))


@FUZZ
@given(structurally_wrong())
def test_a_body_of_the_wrong_shape_is_a_4xx(http, case):
    path, body = case
    assert_openai_error(http.post(path, content=body))


@FUZZ
@given(broken_bytes())
def test_truncated_json_or_invalid_utf8_is_a_400(http, case):
    path, body = case
    assert_openai_error(http.post(path, content=body), 400)


@FUZZ
@given(json_values)
def test_any_json_value_as_a_body_is_a_4xx(http, value):
    body = value if not isinstance(value, dict) else {key: item for key, item in value.items() if key != "model"}
    assert_openai_error(http.post("/v1/completions", content=json.dumps(body).encode()))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "fuzz-model", "prompt": "caf\xe9"}', "not valid UTF-8"),
        (json.dumps({**COMPLETION, "max_tokens": "5"}).encode(), "max_tokens: Input should be a valid integer"),
        (json.dumps({**COMPLETION, "logprobs": 21}).encode(), "logprobs"),
        (json.dumps({**COMPLETION, "prompt": ["a"] * 129}).encode(), "prompt"),
        (json.dumps({**COMPLETION, "temperature": -1}).encode(), "temperature must be >= 0"),
        (json.dumps({**COMPLETION, "prompt": ""}).encode(), "the prompt is empty"),
        (json.dumps({**COMPLETION, "prompt": "Hi " * 600}).encode(), "no room to generate"),
        (json.dumps({**COMPLETION, "guided_json": nested_schema(40)}).encode(), "nests deeper than 64"),
        (json.dumps({**COMPLETION, "logit_bias": {str(i): 1 for i in range(301)}}).encode(), "logit_bias"),
        (json.dumps({**COMPLETION, "logit_bias": {"99999999": 1}}).encode(), "outside the vocabulary"),
        (json.dumps({**COMPLETION, "guided_regex": "a", "guided_choice": ["a"]}).encode(), "at most one"),
        (json.dumps({**COMPLETION, "stop": ["a", "b", "c", "d", "e"]}).encode(), "stop"),
    ],
)
def test_each_kind_of_bad_body_gets_its_own_message(http, body, message):
    response = http.post("/v1/completions", content=body)
    assert_openai_error(response, 400)
    assert message in response.json()["error"]["message"]


def chat_with(**fields: object) -> bytes:
    return json.dumps({**CHAT, "tools": [TOOL], **fields}).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (chat_with(tool_choice={"type": "function", "function": {"name": "fly"}}), "'fly', which is not among the tools"),
        (chat_with(tool_choice="required", tools=None), "needs tools"),
        (chat_with(tools=[{"type": "web_search", "function": TOOL["function"]}]), "tools.0.type"),
        (chat_with(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), "of type object"),
        (chat_with(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}]), "tools[0].function.parameters"),
        (chat_with(tools=[TOOL] * 129), "tools"),  # more than OpenAI's 128
        (chat_with(tools=[TOOL, TOOL]), "defined twice"),
        (chat_with(messages=[{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "lookup", "arguments": "{oops"}}]}]),
         "tool_calls[0].function.arguments is not a JSON object"),
        (chat_with(messages=[{"role": "tool", "tool_call_id": "call_9", "content": "1"}]), "answers no earlier assistant tool call"),
        (chat_with(messages=[{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "1"}]), "needs tool_call_id"),
        (chat_with(messages=[{"role": "user", "content": "a", "tool_calls": [CALL]}]), "only assistant messages carry tool_calls"),
        (chat_with(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]), "function"),
    ],
)
def test_each_kind_of_bad_tool_request_gets_its_own_message(http, body, message):
    response = http.post("/v1/chat/completions", content=body)
    assert_openai_error(response, 400)
    assert message in response.json()["error"]["message"]


def test_the_most_tools_allowed_count_against_the_context_as_the_prompt_they_become(http):
    tools = [{"type": "function", "function": {**TOOL["function"], "name": f"tool_{i}"}} for i in range(128)]
    response = http.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "required"})
    assert_openai_error(response, 400)
    assert "leaves no room to generate" in response.json()["error"]["message"]


def test_a_body_over_the_limit_is_413_whether_or_not_its_length_is_declared(http):
    body = json.dumps({**COMPLETION, "prompt": "a" * MAX_REQUEST_BYTES}).encode()
    assert_openai_error(http.post("/v1/completions", content=body), 413)
    chunks = (body[i : i + 4096] for i in range(0, len(body), 4096))  # no Content-Length: chunked
    assert_openai_error(http.post("/v1/completions", content=chunks), 413)


def test_unknown_path_and_wrong_method_get_openai_errors(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


@pytest.mark.parametrize(
    "extra",
    [
        {"seed": 2**63 - 1, "n": 2},  # the second completion's seed must not overflow int64
        {"seed": -(2**63), "n": 3},
        {"top_k": 10**12},  # more than the vocabulary
        {"temperature": 1e308},
        {"temperature": 1e-300},
        {"top_p": 1e-300},
        {"logprobs": 20},
        {"n": 128, "max_tokens": 1},
        {"stop": ["x"] * 4},
        {"logit_bias": {str(i): 100 for i in range(300)}},
        {"priority": -(2**63)},
        {"max_completion_tokens": 2},
        {"guided_choice": ["x" * 300, "y"]},
        {"repetition_penalty": 1e308, "presence_penalty": 2, "frequency_penalty": -2},
    ],
)
def test_extreme_but_valid_values_are_served(http, extra):
    response = http.post("/v1/completions", json={**COMPLETION, **extra})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == extra.get("n", 1)


def test_the_server_still_serves_after_the_fuzzing(http):
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
