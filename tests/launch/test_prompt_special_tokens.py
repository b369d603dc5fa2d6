"""Text prompts get the special tokens the tokenizer adds by default (a BOS where it adds one);
chat prompts get only the BOS their template writes. ``LLM`` and ``strata generate``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata import LLM, SamplingParams

from model_factory import save_tiny_model, tiny_llama_config
from tiny_tokenizer import BOS_ID, save_tiny_tokenizer

TEXT = "hello world"
CHAT = [{"role": "user", "content": TEXT}]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module", params=[True, False], ids=["tokenizer-adds-bos", "tokenizer-adds-nothing"])
def adds_bos(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture(scope="module")
def model_dir(adds_bos: bool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bos" if adds_bos else "no-bos")
    save_tiny_model(tiny_llama_config(), path)
    save_tiny_tokenizer(path, adds_bos)
    return path


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    with LLM(str(model_dir), executor="uni", dtype="float32") as engine:
        yield engine


def test_text_prompt_starts_with_a_bos_only_where_the_tokenizer_adds_one(llm: LLM, adds_bos: bool) -> None:
    words = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    [output] = llm.generate(TEXT, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == ([BOS_ID] if adds_bos else []) + words


def test_chat_prompt_has_only_the_bos_its_template_writes(llm: LLM) -> None:
    [output] = llm.chat(CHAT, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids[0] == BOS_ID
    assert output.prompt_token_ids.count(BOS_ID) == 1
    assert output.prompt_token_ids == llm.tokenizer.convert_tokens_to_ids(
        ["<s>", "user", ":", "hello", "world", "assistant", ":"]
    )


def test_strata_generate_encodes_the_prompt_as_llm_generate_does(llm: LLM, model_dir: Path, adds_bos: bool) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "strata.launch.cli", "generate", "--model", str(model_dir), "--json",
               "--no-progress", "--executor", "uni", "--dtype", "float32", "--temperature", "0",
               "--max-tokens", str(GREEDY.max_tokens), "--prompt", TEXT]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    [record] = [json.loads(line) for line in result.stdout.splitlines()]
    words = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    with_bos, without_bos = (
        output.outputs[0].token_ids for output in llm.generate([[BOS_ID] + words, words], GREEDY, use_tqdm=False)
    )
    assert with_bos != without_bos, "the tiny model must tell the two prompts apart for this test to mean anything"
    assert record["token_ids"] == (with_bos if adds_bos else without_bos)
