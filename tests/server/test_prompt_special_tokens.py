"""``/v1/completions`` encodes a text prompt with the BOS its tokenizer adds; ``/v1/chat/completions``
keeps only the BOS its chat template writes."""

import httpx
import pytest

from model_factory import save_tiny_model, tiny_llama_config
from server_helpers import running_server
from tiny_tokenizer import save_tiny_tokenizer


@pytest.fixture(scope="module")
def server(log_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bos-model")
    save_tiny_model(tiny_llama_config(), path)
    save_tiny_tokenizer(path, adds_bos=True)
    with running_server(log_dir, "--model", str(path), "--dtype", "float32") as server:
        yield server


def prompt_tokens(server, endpoint: str, body: dict) -> int:
    [model] = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    body = {**body, "model": model["id"], "max_tokens": 1}
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_text_prompt_gets_the_tokenizers_bos(server):
    assert prompt_tokens(server, "completions", {"prompt": "hello world"}) == 3  # <s> hello world


def test_chat_prompt_gets_only_the_templates_bos(server):
    messages = [{"role": "user", "content": "hello world"}]
    # <s> user : hello world assistant : (a second <s> would make 8)
    assert prompt_tokens(server, "chat/completions", {"messages": messages}) == 7
