"""vLLM's ``/tokenize`` and ``/detokenize`` on ``strata serve``: the tokenizer's own ids for a
text, the chat path's for a conversation, the text back from ids, and the same errors and
API key as ``/v1``. One server, with an API key."""

from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from server_helpers import running_server
from strata.worker.model_loader import resolve_model_path

MODEL = "tokenize-model"
API_KEY = "sk-tokenize-key"
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(log_dir):
    with running_server(log_dir, "--served-model-name", MODEL, "--api-key", API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model_path(None))


def post(http: httpx.Client, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_text_tokenizes_as_the_tokenizer_encodes_it(http, tokenizer, add_special_tokens):
    result = post(http, "/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": add_special_tokens})
    assert result["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=add_special_tokens)
    assert result["count"] == len(result["tokens"])
    assert result["token_strs"] is None
    assert result["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]


def test_text_tokenizes_as_a_completion_counts_its_prompt(http):
    tokenized = post(http, "/tokenize", {"prompt": PROMPT})
    completion = post(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert tokenized["count"] == completion["usage"]["prompt_tokens"]


def test_return_token_strs_gives_each_tokens_string(http, tokenizer):
    result = post(http, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(result["tokens"])
    assert len(result["token_strs"]) == result["count"]


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["plain", "with-tools"])
def test_chat_tokenizes_to_the_prompt_a_chat_completion_counts(http, tools):
    extra = {} if tools is None else {"tools": tools}
    tokenized = post(http, "/tokenize", {"model": MODEL, "messages": CHAT, **extra})
    chat = post(http, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1, **extra})
    assert tokenized["count"] == chat["usage"]["prompt_tokens"] == len(tokenized["tokens"])


def test_chat_tokenizes_through_the_chat_template(http, tokenizer):
    result = post(http, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    templated = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert result["tokens"] == tokenizer.encode(templated, add_special_tokens=False)


def test_chat_with_generation_prompt_and_continue_final_message_is_400(http):
    response = http.post("/tokenize", json={"messages": CHAT, "continue_final_message": True})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "continue_final_message"


def test_chat_fields_with_a_text_prompt_are_400(http):
    response = http.post("/tokenize", json={"prompt": PROMPT, "add_generation_prompt": True})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "add_generation_prompt"


def test_detokenize_gives_back_the_tokenized_text(http):
    tokens = post(http, "/tokenize", {"prompt": PROMPT})["tokens"]
    assert post(http, "/detokenize", {"model": MODEL, "tokens": tokens}) == {"prompt": PROMPT}


def test_detokenize_of_ids_outside_the_vocabulary_is_400_naming_tokens(http, tokenizer):
    response = http.post("/detokenize", json={"tokens": [1, len(tokenizer)]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tokens" and str(len(tokenizer)) in error["message"]


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1]})])
def test_another_model_is_404_model_not_found(http, path, body):
    response = http.post(path, json={"model": "no-such-model", **body})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1]})])
def test_the_api_key_is_required(server, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.url}{path}", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
