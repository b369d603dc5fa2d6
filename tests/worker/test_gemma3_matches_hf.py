"""Our Gemma 3 equals transformers on a tiny random checkpoint whose sliding window is shorter
than the prompts, run through the paged cache."""

import pytest
import torch
from transformers import PreTrainedModel

from strata.worker.attention import TorchAttentionBackend
from strata.worker.gemma3 import Gemma3ForCausalLM

from model_factory import hf_greedy, random_prompts, read_as_saved, save_tiny_model, tiny_gemma3_config
from worker_helpers import SINGLE_RANK, PagedRunner, greedy_decode, load_ours

# Ragged, crossing 16-token blocks and the 8-token window.
PROMPT_LENGTHS = [5, 17, 33]
NUM_TOKENS = 10

Models = tuple[PreTrainedModel, Gemma3ForCausalLM]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    path = tmp_path_factory.mktemp("gemma3")
    return save_tiny_model(tiny_gemma3_config(), path), load_ours(path)


@torch.inference_mode()
def hf_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def test_checkpoint_loads_as_gemma3(models: Models) -> None:
    hf, ours = models
    assert isinstance(ours, Gemma3ForCausalLM)
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [8, None, 8, 8]


def test_batched_ragged_prefill_matches_transformers_logits(models: Models) -> None:
    hf, ours = models
    prompts = random_prompts(PROMPT_LENGTHS, ours.vocab_size)
    runner = PagedRunner(ours)
    logits = runner.step([(runner.add_sequence(len(prompt)), prompt) for prompt in prompts])
    for prompt, ours_logits in zip(prompts, logits, strict=True):
        torch.testing.assert_close(ours_logits, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_greedy_tokens_and_logprobs_match_transformers(models: Models) -> None:
    hf, ours = models
    prompts = random_prompts(PROMPT_LENGTHS, ours.vocab_size, seed=1)
    generated, logits = greedy_decode(PagedRunner(ours), prompts, NUM_TOKENS)
    assert generated == [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in prompts]
    # Our logits: every prompt's prefill rows, then one row per prompt and decode step.
    last_prefill_rows = torch.tensor(PROMPT_LENGTHS).cumsum(0) - 1
    decode_rows = logits[sum(PROMPT_LENGTHS) :]
    for i, (prompt, tokens) in enumerate(zip(prompts, generated, strict=True)):
        rows = torch.cat([logits[last_prefill_rows[i], None], decode_rows[i :: len(prompts)]])
        expected = hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1]
        torch.testing.assert_close(rows.log_softmax(-1), expected.log_softmax(-1), atol=1e-3, rtol=0)


def test_prefill_in_chunks_across_the_window_matches_one_prefill(models: Models) -> None:
    hf, ours = models
    (prompt,) = random_prompts([45], ours.vocab_size, seed=2)
    runner = PagedRunner(ours)
    seq = runner.add_sequence(len(prompt))
    # Chunks shorter and longer than the window, one ending inside a block.
    chunks = [runner.step([(seq, prompt[start:stop])])[0] for start, stop in [(0, 5), (5, 21), (21, 24), (24, 45)]]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "setting,value",
    [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True), ("hidden_activation", "silu")],
)
def test_settings_it_does_not_compute_are_refused_by_name(setting: str, value: object) -> None:
    config = tiny_gemma3_config(**{setting: value})
    with pytest.raises(ValueError, match="activation" if setting == "hidden_activation" else setting):
        Gemma3ForCausalLM(read_as_saved(config), SINGLE_RANK, TorchAttentionBackend())
