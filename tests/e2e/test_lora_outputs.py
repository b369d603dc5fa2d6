"""Offline LoRA: in one mixed batch, each prompt's greedy tokens with an adapter equal HF's
with that adapter merged into the base, and the base model's prompts stay the base's; more
adapters than slots swap in and lose nothing. Needs the workers' adapter pool (the worker
side of LoRA)."""

import pytest

from strata import LLM, LoRARequest, SamplingParams

from model_factory import hf_greedy, random_prompts, save_tiny_lora, save_tiny_model, tiny_llama_config

NEW_TOKENS = 8
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora-offline")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    merged = {name: save_tiny_lora(base, root / name, MODULES, rank=8, seed=seed) for seed, name in enumerate("abc", 1)}
    return root, base, merged


def test_adapters_and_the_base_in_one_batch_equal_hf_with_each_adapter_merged(tiny):
    root, base, merged = tiny
    prompts = random_prompts([20, 35, 20, 50], 97, seed=3)
    plan = [None, "a", "b", "c"]  # three adapters, two slots: one waits for a slot and swaps in
    with LLM(model=str(root / "base"), executor="uni", dtype="float32", skip_tokenizer=True,
             enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        requests = [None if name is None else LoRARequest(name, str(root / name)) for name in plan]
        outputs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=requests)
    for prompt, name, output in zip(prompts, plan, outputs):
        model = base if name is None else merged[name]
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, NEW_TOKENS), name
