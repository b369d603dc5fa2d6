"""LoRA adapters in the model runner: one batch mixing two adapters and the base model decodes
what HF computes with each adapter merged by PEFT; slots are reused and the CPU cache evicts."""

from pathlib import Path

import pytest

from strata.engine_core.protocol import LoRASlotLoad
from strata.worker.model_runner import ModelRunner
from worker_helpers import SINGLE_RANK

from lora_helpers import TinyAdapters, save_tiny_adapters
from lora_steps import greedy_steps, lora_config
from model_factory import hf_greedy, random_prompts, save_tiny_model, tiny_gemma3_config, tiny_mixtral_config

NUM_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyAdapters:
    return save_tiny_adapters(tmp_path_factory.mktemp("lora"))


def test_one_batch_of_two_adapters_and_base_rows_decodes_as_hf_with_each_adapter_merged(tiny):
    runner = ModelRunner(lora_config(tiny.model_dir), SINGLE_RANK)
    prompts = random_prompts([9, 14, 5, 11], vocab_size=97)
    # Slots: the second adapter in slot 0, the first in slot 1; two rows of the base model.
    slots = [1, -1, 0, -1]
    loads = [LoRASlotLoad(0, tiny.adapters[1]), LoRASlotLoad(1, tiny.adapters[0])]
    tokens = greedy_steps(runner, prompts, slots, loads, NUM_TOKENS)
    references = [tiny.merged[0], tiny.base, tiny.merged[1], tiny.base]
    expected = [hf_greedy(reference, prompt, NUM_TOKENS) for reference, prompt in zip(references, prompts)]
    assert tokens == expected
    # The adapters change what is decoded (a test of a no-op adapter would pass too).
    assert tokens[0] != hf_greedy(tiny.base, prompts[0], NUM_TOKENS)


def test_gemma3_with_an_adapter_decodes_as_hf_with_it_merged(tmp_path: Path):
    tiny = save_tiny_adapters(tmp_path, tiny_gemma3_config())
    runner = ModelRunner(lora_config(tiny.model_dir), SINGLE_RANK)
    prompts = random_prompts([9, 14], vocab_size=97)
    tokens = greedy_steps(runner, prompts, [0, -1], [LoRASlotLoad(0, tiny.adapters[0])], NUM_TOKENS)
    assert tokens == [hf_greedy(tiny.merged[0], prompts[0], NUM_TOKENS), hf_greedy(tiny.base, prompts[1], NUM_TOKENS)]


def test_a_slot_loaded_with_another_adapter_gives_that_adapters_tokens(tiny):
    runner = ModelRunner(lora_config(tiny.model_dir, max_loras=1), SINGLE_RANK)
    (prompt,) = random_prompts([12], vocab_size=97, seed=3)
    greedy_steps(runner, [prompt], [0], [LoRASlotLoad(0, tiny.adapters[0])], NUM_TOKENS)
    tokens = greedy_steps(runner, [prompt], [0], [LoRASlotLoad(0, tiny.adapters[1])], NUM_TOKENS, first_step=10)
    assert tokens == [hf_greedy(tiny.merged[1], prompt, NUM_TOKENS)]


def test_the_cpu_cache_keeps_the_most_recently_used_adapters_and_reads_evicted_ones_again(tiny):
    runner = ModelRunner(lora_config(tiny.model_dir, max_loras=1, max_cpu_loras=1), SINGLE_RANK)
    (prompt,) = random_prompts([12], vocab_size=97, seed=4)
    first, second = tiny.adapters
    step = 1
    for adapter in (first, second, first):
        tokens = greedy_steps(runner, [prompt], [0], [LoRASlotLoad(0, adapter)], NUM_TOKENS, first_step=step)
        step += NUM_TOKENS + 1
        assert list(runner.lora.cached) == [adapter.lora_id]
    assert tokens == [hf_greedy(tiny.merged[0], prompt, NUM_TOKENS)]


def test_an_adapter_of_a_rank_above_the_pools_is_reported_as_a_failed_load_naming_it(tiny):
    runner = ModelRunner(lora_config(tiny.model_dir, max_lora_rank=4), SINGLE_RANK)
    adapter = tiny.adapters[0]
    errors = runner.lora.load([LoRASlotLoad(0, adapter)])
    assert list(errors) == [adapter.lora_id] and "rank 8, above --max-lora-rank 4" in errors[adapter.lora_id]
    assert f"LoRA adapter {adapter.name!r} could not be loaded" in errors[adapter.lora_id]


def test_a_mixture_of_experts_model_with_lora_enabled_is_refused_at_start(tmp_path: Path):
    save_tiny_model(tiny_mixtral_config(), tmp_path)
    with pytest.raises(ValueError, match="not supported for MixtralForCausalLM"):
        ModelRunner(lora_config(tmp_path), SINGLE_RANK)
