"""The engine on a real GPU: greedy parity with HF transformers, CUDA graphs on == off, the
offload tier's CUDA side stream on == off. Skipped where CUDA is absent (see tests/conftest.py);
``benchmarks/gpu_proof.sh`` runs them."""

import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from strata import LLM, SamplingParams
from strata.worker.model_loader import resolve_model_path

from model_factory import hf_greedy, random_prompts, save_tiny_model, tiny_llama_config

os.environ["HF_HUB_OFFLINE"] = "1"
pytestmark = pytest.mark.gpu

NEW_TOKENS = 32
# bfloat16 rounds differently from HF's kernels, so greedy paths may part where two tokens are
# nearly tied: from the first difference on, the engine's token must be among HF's top few.
BF16_TOP_K = 5
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "The history of computing is a story of layers: transistors became gates, gates became processors,",
]


@pytest.fixture(scope="module")
def default_model_path():
    return resolve_model_path(None)


def engine_tokens(model: str | None, prompts, params: SamplingParams, **engine_args) -> list[list[int]]:
    with LLM(model, device="cuda", **engine_args) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_greedy_matches_hf_on_the_gpu(dtype, default_model_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = engine_tokens(None, prompts, params, executor="uni", dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=getattr(torch, dtype)).to("cuda").eval()
    for prompt, tokens in zip(prompts, ours):
        expected = hf_greedy(reference, prompt, NEW_TOKENS)
        if dtype == "float32":
            assert tokens == expected
            continue
        common = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected))
        if common < len(expected):
            with torch.inference_mode():
                logits = reference(torch.tensor([prompt + tokens[:common]], device="cuda")).logits[0, -1]
            assert tokens[common] in logits.topk(BF16_TOP_K).indices.tolist(), f"parted at token {common}"


def test_cuda_graphs_on_give_the_tokens_of_eager(default_model_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    # Five prompts: their decode steps run at padded graph sizes (5 -> 8, then fewer as they end).
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    eager = engine_tokens(None, prompts, params, executor="uni", dtype="float32", enforce_eager=True)
    graphs = engine_tokens(None, prompts, params, executor="mp", dtype="float32", max_num_seqs=16)
    assert graphs == eager


def test_offload_tier_on_gives_the_tokens_of_off_with_the_cuda_side_stream(tmp_path, default_model_path):
    config = tiny_llama_config(max_position_embeddings=2048)
    save_tiny_model(config, tmp_path)
    AutoTokenizer.from_pretrained(default_model_path).save_pretrained(tmp_path)
    rng = random.Random(0)
    doc_a, doc_b = ([rng.randrange(3, 97) for _ in range(1024)] for _ in range(2))
    questions = random_prompts([16] * 6, vocab_size=97, seed=1)
    rounds = [(doc_a if i % 2 == 0 else doc_b) + questions[i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(**offload):
        with LLM(str(tmp_path), device="cuda", executor="uni", dtype="float32", num_gpu_blocks=80, **offload) as llm:
            tokens = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in rounds]
            return tokens, llm.stats

    without, _ = run()
    with_offload, stats = run(kv_offload_cpu_bytes=256 * 1024 * 1024)
    assert with_offload == without
    assert stats.offload_hit_tokens > 0
