"""LoRA adapters on ``strata serve``: a request's ``model`` picks the base or an adapter,
``/v1/models`` lists adapters under their base, adapters load and unload at run time behind
the API key (while requests stream), every refusal is an OpenAI error body that says why, and
an adapter whose files vanish fails its requests while the engine serves on. One server, a
tiny random Llama with one adapter from the start."""

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from server_helpers import BackgroundStream, running_server
from strata.launch.server.models import ServedModels
from strata.launch.server.protocol import APIError, LoadLoRAAdapterRequest

BASE = "tiny-base"
API_KEY = "sk-lora-key"
PROMPT = "the sea is blue"
LONG_STREAM_TOKENS = 240  # with the prompt, within the model's 256 positions


@pytest.fixture(scope="module")
def server(log_dir, lora_models):
    flags = (
        "--model", str(lora_models.root / "base"), "--served-model-name", BASE, "--dtype", "float32",
        "--api-key", API_KEY, "--lora-modules", f"sql={lora_models.root / 'sql'}", "--max-lora-rank", "8",
        "--max-loras", "2", "--enable-lora-runtime-updates",
    )
    with running_server(log_dir, *flags) as server:
        yield server


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as client:
        yield client


def complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})


def load(http: httpx.Client, name: str, path: Path) -> None:
    response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert response.status_code == 200, response.text


def unload(http: httpx.Client, name: str) -> None:
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert response.status_code == 200, response.text


def test_models_list_the_base_and_each_adapter_with_the_base_as_parent(http, lora_models):
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards[BASE]["parent"] is None
    assert cards["sql"]["parent"] == BASE and cards["sql"]["root"] == str((lora_models.root / "sql").resolve())
    assert http.get("/v1/models/sql").json()["parent"] == BASE


def test_a_request_for_an_adapter_is_answered_under_its_name(http):
    for model in (BASE, "sql"):
        response = complete(http, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model


def test_tokenization_takes_an_adapters_name(http):
    response = http.post("/tokenize", json={"model": "sql", "prompt": "hello world"})
    assert response.status_code == 200, response.text


def test_an_unknown_model_is_a_404_in_openais_format(http):
    response = complete(http, "nobody")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found" and "'nobody'" in response.json()["error"]["message"]


def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(http, lora_models):
    body = {"lora_name": "chat", "lora_path": str(lora_models.root / "chat")}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 200, response.text
    assert complete(http, "chat").status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    assert complete(http, "chat").status_code == 404
    assert "chat" not in {card["id"] for card in http.get("/v1/models").json()["data"]}


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({"lora_name": "big", "lora_path": "too-big"}, 400, "rank 16, above --max-lora-rank 8"),
        ({"lora_name": "gone", "lora_path": "missing"}, 400, "has no adapter_config.json"),
        ({"lora_name": "sql", "lora_path": "sql"}, 400, "already loaded"),
        ({"lora_name": BASE, "lora_path": "sql"}, 400, "the base model's name"),
    ],
    ids=["rank-too-big", "missing-files", "name-taken", "base-name"],
)
def test_an_adapter_that_cannot_be_served_is_refused_with_the_reason(http, lora_models, body, status, reason):
    body = {**body, "lora_path": str(lora_models.root / body["lora_path"])}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == status and reason in response.json()["error"]["message"]
    assert complete(http, BASE).status_code == 200  # the engine serves on


def test_unloading_an_unknown_adapter_is_a_404(http):
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "nobody"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "lora_name"


def test_the_adapter_endpoints_need_the_api_key(server, lora_models):
    body = {"lora_name": "chat", "lora_path": str(lora_models.root / "chat")}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=30).status_code == 401


def test_without_runtime_updates_the_adapter_endpoints_are_404():
    engine = SimpleNamespace(args=SimpleNamespace(enable_lora_runtime_updates=False))
    with pytest.raises(APIError, match="--enable-lora-runtime-updates") as refused:
        asyncio.run(ServedModels(engine, BASE).load(LoadLoRAAdapterRequest(lora_name="a", lora_path="/a")))
    assert refused.value.status == 404


def test_adapters_load_and_unload_while_requests_stream(server, http, lora_models):
    load(http, "streamed-a", lora_models.root / "sql")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    streams = {
        name: BackgroundStream(client, model, f"{PROMPT} {index}", LONG_STREAM_TOKENS)
        for index, (name, model) in enumerate([("base", BASE), ("base-2", BASE), ("a", "streamed-a"), ("a-2", "streamed-a")])
    }
    for stream in streams.values():
        assert stream.started.wait(300)
    load(http, "streamed-b", lora_models.root / "chat")
    assert complete(http, "streamed-b").status_code == 200
    unload(http, "streamed-a")
    refused = complete(http, "streamed-a")
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    tokens_at_unload = {name: len(stream.tokens) for name, stream in streams.items()}
    for name, stream in streams.items():
        stream.wait()
        assert stream.error is None, f"{name}: {stream.error}"
        assert stream.finish_reason == "length" and len(stream.tokens) == LONG_STREAM_TOKENS, name
    # The unload came while the adapter's streams ran: they got tokens after it.
    assert all(tokens_at_unload[name] < LONG_STREAM_TOKENS for name in ("a", "a-2")), tokens_at_unload
    unload(http, "streamed-b")


def test_an_adapter_whose_files_vanish_fails_its_requests_and_the_engine_serves_on(http, lora_models, tmp_path):
    shutil.copytree(lora_models.root / "chat", tmp_path / "doomed")
    load(http, "doomed", tmp_path / "doomed")
    shutil.rmtree(tmp_path / "doomed")  # before any request put it in a slot
    for _ in range(2):  # and again: that load stays failed
        response = complete(http, "doomed")
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "LoRA adapter 'doomed' could not be loaded" in message and "has no adapter_config.json" in message
    assert complete(http, BASE).status_code == complete(http, "sql").status_code == 200
    unload(http, "doomed")
