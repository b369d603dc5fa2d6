"""LoRA adapters on ``strata serve``: a request's ``model`` picks the base or an adapter,
``/v1/models`` lists adapters under their base, adapters load and unload at run time behind
the API key, and every refusal is an OpenAI error body that says why. One server, a tiny
random Llama with one adapter from the start."""

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from model_factory import save_tiny_lora, save_tiny_model, tiny_llama_config
from server_helpers import running_server
from strata.launch.server.models import ServedModels
from strata.launch.server.protocol import APIError, LoadLoRAAdapterRequest
from tiny_tokenizer import save_tiny_tokenizer

BASE = "tiny-base"
API_KEY = "sk-lora-key"
PROMPT = "the sea is blue"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The base model's and the adapters' directories, under ``root``."""
    root = tmp_path_factory.mktemp("lora-serve")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    save_tiny_tokenizer(root / "base", adds_bos=True)
    for name, rank, seed in [("sql", 8, 1), ("chat", 4, 2), ("too-big", 16, 3)]:
        save_tiny_lora(base, root / name, MODULES, rank=rank, seed=seed)
    return SimpleNamespace(root=root)


@pytest.fixture(scope="module")
def server(log_dir, models):
    flags = (
        "--model", str(models.root / "base"), "--served-model-name", BASE, "--dtype", "float32",
        "--api-key", API_KEY, "--lora-modules", f"sql={models.root / 'sql'}", "--max-lora-rank", "8",
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


def test_models_list_the_base_and_each_adapter_with_the_base_as_parent(http, models):
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards[BASE]["parent"] is None
    assert cards["sql"]["parent"] == BASE and cards["sql"]["root"] == str((models.root / "sql").resolve())
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


def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(http, models):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(models.root / "chat")})
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
def test_an_adapter_that_cannot_be_served_is_refused_with_the_reason(http, models, body, status, reason):
    body = {**body, "lora_path": str(models.root / body["lora_path"])}
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == status and reason in response.json()["error"]["message"]
    assert complete(http, BASE).status_code == 200  # the engine serves on


def test_unloading_an_unknown_adapter_is_a_404(http):
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "nobody"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "lora_name"


def test_the_adapter_endpoints_need_the_api_key(server, models):
    body = {"lora_name": "chat", "lora_path": str(models.root / "chat")}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=30).status_code == 401


def test_without_runtime_updates_the_adapter_endpoints_are_404():
    engine = SimpleNamespace(args=SimpleNamespace(enable_lora_runtime_updates=False))
    with pytest.raises(APIError, match="--enable-lora-runtime-updates") as refused:
        asyncio.run(ServedModels(engine, BASE).load(LoadLoRAAdapterRequest(lora_name="a", lora_path="/a")))
    assert refused.value.status == 404
