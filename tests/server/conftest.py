"""Server tests run offline; each module keeps its servers' logs in one directory."""

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")
