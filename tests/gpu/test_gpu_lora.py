"""LoRA adapters on a real GPU, where the Triton kernels (``kernels/triton_lora.py``) add the
deltas: in one batch of the base model and three adapters sharing two slots (one waits and swaps
in), each prompt's greedy tokens in float32 equal HF's with that adapter merged by PEFT, on the
GPU. Skipped where CUDA is absent (see tests/conftest.py), or peft is (the reference needs it);
``benchmarks/gpu_proof.sh`` runs it."""

import pytest

from strata import LLM, LoRARequest, SamplingParams

from model_factory import hf_greedy, random_prompts, save_tiny_lora, save_tiny_model, tiny_llama_config

pytestmark = pytest.mark.gpu

NEW_TOKENS = 16
VOCAB_SIZE = 97  # the tiny configs' (model_factory._TINY)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_adapters_and_the_base_in_one_gpu_batch_equal_hf_with_each_adapter_merged(tmp_path):
    pytest.importorskip("peft", reason="the reference merges the adapters with peft")
    base = save_tiny_model(tiny_llama_config(), tmp_path / "base")
    merged = {
        "a": save_tiny_lora(base, tmp_path / "a", MODULES, rank=8, seed=1),
        "b": save_tiny_lora(base, tmp_path / "b", ("q_proj", "v_proj", "down_proj"), rank=4, seed=2, use_rslora=True),
        "c": save_tiny_lora(base, tmp_path / "c", MODULES, rank=16, seed=3),
    }
    # Prompts long enough that prefills span several of the kernels' 16-token tiles.
    prompts = random_prompts([20, 35, 20, 50, 9], VOCAB_SIZE, seed=3)
    plan = [None, "a", "b", "c", "a"]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=str(tmp_path / "base"), device="cuda", executor="uni", dtype="float32", skip_tokenizer=True,
             num_gpu_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        requests = [None if name is None else LoRARequest(name, str(tmp_path / name)) for name in plan]
        outputs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=requests)
    for prompt, name, output in zip(prompts, plan, outputs):
        reference = (base if name is None else merged[name]).to("cuda")
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt, NEW_TOKENS), name
