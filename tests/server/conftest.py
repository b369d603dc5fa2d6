"""Server tests run offline; each module keeps its servers' logs in one directory."""

import os
from pathlib import Path

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
