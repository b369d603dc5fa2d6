"""Server tests run offline; each module keeps its servers' logs in one directory."""

import os
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The official client on the module's ``server``."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny random Llama with a tokenizer (``root / "base"``) and PEFT adapters of it beside
    it: ``sql`` (rank 8), ``chat`` and ``poem`` (rank 4), ``too-big`` (rank 16)."""
    # Imported here: torch and peft are for the LoRA tests only.
    from model_factory import save_tiny_lora, save_tiny_model, tiny_llama_config
    from tiny_tokenizer import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("lora-serve")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    save_tiny_tokenizer(root / "base", adds_bos=True)
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, rank, seed in [("sql", 8, 1), ("chat", 4, 2), ("too-big", 16, 3), ("poem", 4, 4)]:
        save_tiny_lora(base, root / name, modules, rank=rank, seed=seed)
    return SimpleNamespace(root=root)
