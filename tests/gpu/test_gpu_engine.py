"""The engine on a real GPU: greedy parity with HF transformers, CUDA graphs on == off, the
torch backend without graphs, bfloat16 and fp8 KV caches on Triton == on the torch backend, the
offload tier's CUDA side stream on == off, and a shut-down engine's memory handed back. Skipped where CUDA is absent (see tests/conftest.py);
``benchmarks/gpu_proof.sh`` runs them.

Every engine runs a seeded tiny random checkpoint on token-id prompts (no model package, no
tokenizer, nothing to download) with a fixed small KV cache, so that the engines a pytest
process builds one after another all fit on the device."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata import LLM, SamplingParams

from model_factory import hf_greedy, random_prompts, save_tiny_model, tiny_llama_config, tiny_qwen3_config

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32
NUM_GPU_BLOCKS = 128
VOCAB_SIZE = 97  # the tiny configs' (model_factory._TINY)
# bfloat16 rounds differently from HF's kernels, so greedy paths may part where two tokens are
# nearly tied: from the first difference on, the engine's token must be among HF's top few.
BF16_TOP_K = 5
# The tiny configs have no EOS token, so neither HF's generate nor the engine stops early.
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(tiny_llama_config(max_position_embeddings=2048), path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_qwen3_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_model(tiny_qwen3_config(), path)
    return str(path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Five prompts: their decode steps run at padded graph sizes (5 -> 8).
    return random_prompts([5, 9, 17, 3, 30], VOCAB_SIZE)


def engine_tokens(model: str, prompts, params: SamplingParams, **engine_args) -> list[list[int]]:
    engine_args = {"num_gpu_blocks": NUM_GPU_BLOCKS} | engine_args
    with LLM(model, device="cuda", skip_tokenizer=True, **engine_args) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def assert_greedy_matches_hf(model: str, dtype: str, prompts: list[list[int]]) -> None:
    """float32: HF's tokens exactly; bfloat16: HF's tokens up to a near-tie, then among its top few."""
    ours = engine_tokens(model, prompts, GREEDY, executor="uni", dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to("cuda").eval()
    for prompt, tokens in zip(prompts, ours):
        expected = hf_greedy(reference, prompt, NEW_TOKENS)
        assert len(expected) == NEW_TOKENS  # HF did not stop at an EOS
        if dtype == "float32":
            assert tokens == expected
            continue
        common = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected))
        if common < len(expected):
            with torch.inference_mode():
                logits = reference(torch.tensor([prompt + tokens[:common]], device="cuda")).logits[0, -1]
            assert tokens[common] in logits.topk(BF16_TOP_K).indices.tolist(), f"parted at token {common}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_llama_greedy_matches_hf_on_the_gpu(dtype, tiny_model, prompts):
    assert_greedy_matches_hf(tiny_model, dtype, prompts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_qwen3_greedy_matches_hf_on_the_gpu(dtype, tiny_qwen3_model, prompts):
    assert_greedy_matches_hf(tiny_qwen3_model, dtype, prompts)


def test_cuda_graphs_on_give_the_tokens_of_eager(tiny_model, prompts):
    eager = engine_tokens(tiny_model, prompts, GREEDY, executor="uni", dtype="float32", enforce_eager=True)
    graphs = engine_tokens(tiny_model, prompts, GREEDY, executor="mp", dtype="float32", max_num_seqs=16)
    assert graphs == eager


def test_the_torch_backend_runs_uncaptured_and_gives_the_tokens_of_triton(tiny_model, prompts):
    triton = engine_tokens(tiny_model, prompts, GREEDY, executor="uni", dtype="float32", attention_backend="triton")
    torch_backend = engine_tokens(tiny_model, prompts, GREEDY, executor="uni", dtype="float32", attention_backend="torch")
    assert torch_backend == triton


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_a_narrower_kv_cache_gives_triton_the_tokens_of_the_torch_backend_over_it(kv_cache_dtype, tiny_model, prompts):
    """Keys and values rounded by torch as they are written, then converted by the Triton kernel
    as it loads them (float8 e4m3 compiled for the GPU), against the reference over the same cache."""
    args = {"executor": "uni", "dtype": "float32", "kv_cache_dtype": kv_cache_dtype}
    triton = engine_tokens(tiny_model, prompts, GREEDY, attention_backend="triton", **args)
    torch_backend = engine_tokens(tiny_model, prompts, GREEDY, attention_backend="torch", **args)
    assert triton == torch_backend


def test_a_shut_down_engine_gives_its_gpu_memory_back(tiny_model, prompts):
    # 65536 blocks of 8 KiB: a 512 MiB KV cache. What may stay is per-process state such as
    # cuBLAS's workspace.
    held_before = torch.cuda.memory_reserved()
    engine_tokens(tiny_model, prompts, GREEDY, executor="uni", dtype="float32", num_gpu_blocks=65536)
    assert torch.cuda.memory_reserved() - held_before < 64 << 20


def test_offload_tier_on_gives_the_tokens_of_off_with_the_cuda_side_stream(tiny_model):
    rng = random.Random(0)
    doc_a, doc_b = ([rng.randrange(3, VOCAB_SIZE) for _ in range(1024)] for _ in range(2))
    questions = random_prompts([16] * 6, vocab_size=VOCAB_SIZE, seed=1)
    rounds = [(doc_a if i % 2 == 0 else doc_b) + questions[i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(**offload):
        with LLM(tiny_model, device="cuda", executor="uni", dtype="float32", num_gpu_blocks=80, skip_tokenizer=True, **offload) as llm:
            tokens = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt in rounds]
            return tokens, llm.stats

    without, _ = run()
    with_offload, stats = run(kv_offload_cpu_bytes=256 * 1024 * 1024)
    assert with_offload == without
    assert stats.offload_hit_tokens > 0
