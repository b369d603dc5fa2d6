"""Two gloo ranks with LoRA adapters decode what HF computes with each adapter merged: column-
parallel linears split B by output rows, row-parallel ones A by input columns."""

from lora_helpers import save_tiny_adapters
from model_factory import hf_greedy, random_prompts
from tp_ranks import run_lora_ranks

NUM_TOKENS = 4
PROMPT_LENGTHS = [9, 14, 5]
SLOTS = [0, 1, -1]


def test_two_ranks_with_adapters_decode_as_hf_with_each_adapter_merged(tmp_path):
    tiny = save_tiny_adapters(tmp_path)
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=97)
    tokens = run_lora_ranks(tiny.model_dir, tiny.adapters, prompts, SLOTS, NUM_TOKENS, tmp_path / "tokens.json")
    references = [tiny.merged[0], tiny.merged[1], tiny.base]
    assert tokens == [hf_greedy(model, prompt, NUM_TOKENS) for model, prompt in zip(references, prompts)]
