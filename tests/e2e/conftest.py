import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from strata.worker.model_loader import resolve_model_path

from model_factory import save_tiny_model, tiny_gemma3_config, tiny_llama_config, tiny_qwen2_config

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return resolve_model_path(None)


def save_tiny_model_with_tokenizer(kind: str, path: Path, default_model_path: Path, **overrides):
    """A tiny random checkpoint plus the default model's tokenizer, so ``LLM`` can load it."""
    if kind == "qwen2":
        config = tiny_qwen2_config()
    else:
        config = {"llama": tiny_llama_config, "gemma3": tiny_gemma3_config}[kind](**overrides)
    model = save_tiny_model(config, path)
    AutoTokenizer.from_pretrained(default_model_path).save_pretrained(path)
    return model
