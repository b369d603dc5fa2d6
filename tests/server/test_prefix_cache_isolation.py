"""Tenant isolation of the prefix cache over HTTP: ``cache_salt`` on both endpoints, and
``--prefix-cache-isolation per-api-key``. A request hits cached blocks only when an earlier
request had the same salt (and, with isolation on, the same API key)."""

import httpx
import pytest

from server_helpers import ServerProcess, running_server

MODEL = "isolation-model"
KEYS = ("sk-tenant-one", "sk-tenant-two")


@pytest.fixture(scope="module")
def server(log_dir):
    flags = ["--served-model-name", MODEL, "--enable-debug-endpoints", "--prefix-cache-isolation", "per-api-key"]
    for key in KEYS:
        flags += ["--api-key", key]
    with running_server(log_dir, *flags) as server:
        yield server


def long_prompt(topic: str) -> str:
    return f"A report on {topic}. " + " ".join(f"Paragraph {i} says that {topic} matters." for i in range(12))


def hit_tokens_of(server: ServerProcess, key: str, path: str, body: dict) -> int:
    """How many prompt tokens the request found in the prefix cache."""
    before = httpx.get(f"{server.url}/debug/state", timeout=30).json()["prefix_cache_hits"]
    response = httpx.post(
        f"{server.url}{path}", json={"model": MODEL, "max_tokens": 1, **body},
        headers={"Authorization": f"Bearer {key}"}, timeout=120,
    )
    assert response.status_code == 200, response.text
    return httpx.get(f"{server.url}/debug/state", timeout=30).json()["prefix_cache_hits"] - before


def test_completions_share_cached_blocks_only_with_the_same_cache_salt(server):
    body = {"prompt": long_prompt("salted completions")}
    assert hit_tokens_of(server, KEYS[0], "/v1/completions", {**body, "cache_salt": "a"}) == 0
    assert hit_tokens_of(server, KEYS[0], "/v1/completions", {**body, "cache_salt": "b"}) == 0
    assert hit_tokens_of(server, KEYS[0], "/v1/completions", body) == 0
    assert hit_tokens_of(server, KEYS[0], "/v1/completions", {**body, "cache_salt": "a"}) > 0


def test_chat_completions_share_cached_blocks_only_with_the_same_cache_salt(server):
    body = {"messages": [{"role": "user", "content": long_prompt("salted chats")}]}
    assert hit_tokens_of(server, KEYS[0], "/v1/chat/completions", {**body, "cache_salt": "a"}) == 0
    assert hit_tokens_of(server, KEYS[0], "/v1/chat/completions", {**body, "cache_salt": "b"}) == 0
    assert hit_tokens_of(server, KEYS[0], "/v1/chat/completions", {**body, "cache_salt": "a"}) > 0


def test_requests_with_different_api_keys_share_no_cached_block(server):
    body = {"prompt": long_prompt("two tenants")}
    assert hit_tokens_of(server, KEYS[0], "/v1/completions", body) == 0
    assert hit_tokens_of(server, KEYS[1], "/v1/completions", body) == 0
    assert hit_tokens_of(server, KEYS[1], "/v1/completions", body) > 0
    assert hit_tokens_of(server, KEYS[0], "/v1/completions", body) > 0


def test_every_configured_api_key_opens_v1_and_no_other(server):
    for key in KEYS:
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sk-other"}).status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_empty_cache_salt_is_refused_naming_the_field(server):
    response = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "cache_salt": ""},
        headers={"Authorization": f"Bearer {KEYS[0]}"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
