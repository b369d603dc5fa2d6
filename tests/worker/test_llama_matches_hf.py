"""Every Llama-family model (Llama, Mistral with its sliding window, Qwen2, Qwen3, Qwen3-MoE,
Mixtral) equals transformers on tiny random checkpoints, run through the paged cache."""

import pytest
import torch
from transformers import PreTrainedModel

from strata.worker.llama import LlamaForCausalLM

from model_factory import TINY_CONFIGS, hf_greedy, random_prompts, save_tiny_model
from worker_helpers import PagedRunner, greedy_decode, load_ours

# Ragged, and crossing 16-token block boundaries.
PROMPT_LENGTHS = [5, 17, 33]

Models = tuple[PreTrainedModel, LlamaForCausalLM]  # (the HF reference, ours loaded from its checkpoint)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Models:
    path = tmp_path_factory.mktemp(request.param)
    return save_tiny_model(TINY_CONFIGS[request.param](), path), load_ours(path)


@torch.inference_mode()
def hf_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0]


def test_batched_ragged_prefill_matches_transformers_logits(models: Models) -> None:
    hf, ours = models
    prompts = random_prompts(PROMPT_LENGTHS, ours.vocab_size)
    runner = PagedRunner(ours)
    logits = runner.step([(runner.add_sequence(len(prompt)), prompt) for prompt in prompts])
    for prompt, ours_logits in zip(prompts, logits, strict=True):
        torch.testing.assert_close(ours_logits, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_batched_greedy_decode_matches_transformers_generate(models: Models) -> None:
    hf, ours = models
    prompts = random_prompts(PROMPT_LENGTHS, ours.vocab_size, seed=1)
    generated, _ = greedy_decode(PagedRunner(ours), prompts, num_tokens=10)
    assert generated == [hf_greedy(hf, prompt, num_tokens=10) for prompt in prompts]


def test_prefill_in_two_chunks_attends_to_the_cached_first_chunk(models: Models) -> None:
    hf, ours = models
    (prompt,) = random_prompts([37], ours.vocab_size, seed=2)
    runner = PagedRunner(ours)
    seq = runner.add_sequence(len(prompt))
    # Split inside a block, so the second chunk continues a partly filled block.
    (first,) = runner.step([(seq, prompt[:21])])
    (second,) = runner.step([(seq, prompt[21:])])
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)
