"""Two gloo ranks compute the same full-vocabulary logits as one rank (Llama family, Gemma 3)."""

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedConfig

from model_factory import TINY_CONFIGS, random_prompts, save_tiny_model, tiny_gemma3_config, tiny_llama_config
from tp_ranks import DECODE_TOKENS, load_int8, load_widened_bf16, run_ranks
from worker_helpers import SINGLE_RANK, PagedRunner, greedy_decode, load_gguf_blocks, load_ours

PROMPT_LENGTHS = [7, 20]


@pytest.mark.parametrize(
    "num_kv_heads",
    [pytest.param(1, id="kv-heads-replicated"), pytest.param(4, id="kv-heads-sharded")],
)
def test_two_ranks_give_the_logits_of_one_rank(num_kv_heads: int, tmp_path: Path) -> None:
    # Biases on every projection check that a row-parallel bias is added once, after the
    # all-reduce; an odd vocabulary pads the last rank's shard; the tied head shares it.
    config = tiny_llama_config(
        num_key_value_heads=num_kv_heads, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    )
    assert_two_ranks_give_the_logits_of_one(config, tmp_path)


def test_two_ranks_give_the_logits_of_one_rank_for_gemma3(tmp_path: Path) -> None:
    # KV heads sharded, a sliding window shorter than the 20-token prompt, softcapped logits.
    assert_two_ranks_give_the_logits_of_one(tiny_gemma3_config(), tmp_path)


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_through_gloo_give_the_logits_of_one_rank(tmp_path: Path) -> None:
    config = tiny_llama_config(num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True)
    assert_two_ranks_give_the_logits_of_one(config, tmp_path, device="cuda:0")


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_two_expert_parallel_ranks_give_the_logits_of_one_rank(kind: str, tmp_path: Path) -> None:
    # 6 and 5 experts over 2 ranks: each rank computes only the tokens routed to its experts.
    assert_two_ranks_give_the_logits_of_one(TINY_CONFIGS[kind](), tmp_path)


def test_two_ranks_of_a_bfloat16_model_on_fused_cpu_layers_give_the_logits_of_one_rank(tmp_path: Path) -> None:
    # The decode steps run each layer's fused C halves with an all-reduce after each. Every rank
    # rounds its partial sums to bfloat16 before the reduce, so the logits agree to bfloat16's
    # precision, not float32's (measured: 0.03 at most; a missing all-reduce: 3).
    save_tiny_model(tiny_llama_config(), tmp_path)
    one_rank = load_widened_bf16(tmp_path, SINGLE_RANK)
    assert all(layer.fused is not None for layer in one_rank.model.layers)
    prompts = random_prompts(PROMPT_LENGTHS, one_rank.vocab_size)
    _, expected = greedy_decode(PagedRunner(one_rank), prompts, DECODE_TOKENS)
    for rank_logits in run_ranks(tmp_path, tmp_path, prompts, load="bfloat16"):
        torch.testing.assert_close(rank_logits, expected, atol=6e-2, rtol=3e-2)


def test_two_ranks_of_the_default_model_on_gguf_blocks_give_the_logits_of_one_rank(tmp_path: Path) -> None:
    # Row-parallel layers split their input at whole Q4_1 blocks (288 of 576 features: 9 blocks),
    # and each rank quantizes the same runs of 32 activations one rank would: only the order of
    # the float32 sums differs, which may tip an activation's int16 rounding in a later layer
    # (measured: 0.005 at most on logits of magnitude ~20; a missing all-reduce: several units).
    one_rank = load_gguf_blocks(None)
    prompts = random_prompts(PROMPT_LENGTHS, one_rank.vocab_size)
    _, expected = greedy_decode(PagedRunner(one_rank), prompts, DECODE_TOKENS)
    for rank_logits in run_ranks(tmp_path, tmp_path, prompts, load="gguf"):
        torch.testing.assert_close(rank_logits, expected, atol=1e-2, rtol=1e-3)


def test_two_ranks_of_an_int8_model_give_the_logits_of_one_rank(tmp_path: Path) -> None:
    # Column-parallel ranks quantize their own rows; row-parallel ranks hold half of every row,
    # so each row's scale comes from the maximum over both ranks: a rank-local scale would
    # change the quantized weights and the logits by far more than float32 rounding.
    save_tiny_model(tiny_llama_config(num_key_value_heads=4, attention_bias=True, mlp_bias=True), tmp_path)
    prompts = random_prompts(PROMPT_LENGTHS, 97)
    _, expected = greedy_decode(PagedRunner(load_int8(tmp_path, SINGLE_RANK)), prompts, DECODE_TOKENS)
    for rank_logits in run_ranks(tmp_path, tmp_path, prompts, load="int8"):
        torch.testing.assert_close(rank_logits, expected, atol=1e-4, rtol=1e-4)


def assert_two_ranks_give_the_logits_of_one(config: PreTrainedConfig, tmp_path: Path, device: str = "cpu") -> None:
    save_tiny_model(config, tmp_path)
    prompts = random_prompts(PROMPT_LENGTHS, config.vocab_size)
    _, expected = greedy_decode(PagedRunner(load_ours(tmp_path, device=device)), prompts, DECODE_TOKENS)
    for rank_logits in run_ranks(tmp_path, tmp_path, prompts, device):
        torch.testing.assert_close(rank_logits, expected.cpu(), atol=1e-4, rtol=1e-4)
