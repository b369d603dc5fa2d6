import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from strata.worker.model_loader import resolve_model_path

from model_factory import TINY_CONFIGS, save_tiny_model, tiny_gemma3_config

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return resolve_model_path(None)


def save_tiny_model_with_tokenizer(kind: str, path: Path, default_model_path: Path, **overrides):
    """A tiny random checkpoint plus the default model's tokenizer, so ``LLM`` can load it."""
    config = (TINY_CONFIGS | {"gemma3_text": tiny_gemma3_config})[kind](**overrides)
    model = save_tiny_model(config, path)
    AutoTokenizer.from_pretrained(default_model_path).save_pretrained(path)
    return model
