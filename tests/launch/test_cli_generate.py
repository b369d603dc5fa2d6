"""``strata generate`` as a user runs it: a subprocess on the default model."""

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer, GPT2Config

from strata.worker.model_loader import resolve_model_path

PROMPTS = ["The capital of France is", "Once upon a time"]


def strata(*args: str) -> subprocess.CompletedProcess[str]:
    # One torch thread: these tests time nothing, and on a shared machine a second thread mostly waits.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "strata.launch.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def generate_json(*args: str) -> list[dict]:
    """Greedy ``strata generate --json`` on the in-process executor; the parsed lines."""
    result = strata("generate", "--json", "--no-progress", "--executor", "uni", "--temperature", "0", *args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_json_prints_one_object_per_prompt_in_order():
    records = generate_json("--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", "4")
    assert [record["prompt"] for record in records] == PROMPTS
    for record in records:
        assert set(record) == {"prompt", "text", "token_ids", "finish_reason"}
        assert record["finish_reason"] == "length"
        assert len(record["token_ids"]) == 4
        assert record["text"]


def test_chat_sends_the_prompt_through_the_chat_template():
    question = "What is the capital of France?"
    templated = AutoTokenizer.from_pretrained(resolve_model_path(None)).apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    [chat] = generate_json("--chat", "--prompt", question, "--max-tokens", "8")
    [plain] = generate_json("--prompt", templated, "--max-tokens", "8")
    assert chat["prompt"] == question
    assert chat["token_ids"] == plain["token_ids"]


def test_text_output_shows_each_prompt_with_its_completion():
    result = strata("generate", "--no-progress", "--executor", "uni", "--max-tokens", "4", "--prompt", PROMPTS[0])
    assert result.returncode == 0, result.stderr
    prompt_line, output_line = result.stdout.splitlines()[:2]
    assert prompt_line == f"Prompt: {PROMPTS[0]!r}"
    assert output_line.startswith("Output: ")


def test_no_progress_bar_when_stderr_is_not_a_terminal():
    result = strata("generate", "--executor", "uni", "--max-tokens", "2", "--prompt", PROMPTS[0])
    assert result.returncode == 0, result.stderr
    assert "Generating" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "-1", "temperature must be >= 0"),  # refused by SamplingParams
        ("--tensor-parallel-size", "0", "tensor_parallel_size must be >= 1"),  # by EngineArgs
        ("--top-k", "many", "invalid int value"),  # by argparse
    ],
)
def test_bad_flag_value_exits_2_with_a_one_line_error(flag, value, message):
    result = strata("generate", "--prompt", "Hello", flag, value)
    assert result.returncode == 2
    assert result.stderr.startswith("strata generate: error: ")
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_unsupported_architecture_exits_2_with_one_line_naming_it(tmp_path):
    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    result = strata("generate", "--model", str(tmp_path), "--prompt", "Hello")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "model type 'gpt2' (GPT2LMHeadModel) is not supported; supported model types: " in result.stderr
    assert "qwen3_moe" in result.stderr
