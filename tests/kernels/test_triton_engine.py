"""The whole engine on the Triton attention backend (the interpreter on CPU, compiled on a GPU)
gives the same greedy tokens as on the torch reference backend."""

from strata import LLM, SamplingParams

from model_factory import random_prompts, save_tiny_model, tiny_llama_config


def test_triton_backend_engine_run_equals_torch_backend(tmp_path):
    save_tiny_model(tiny_llama_config(), tmp_path)
    # Ragged prompts, a budget that chunks the longest one, decodes mixed with prefill.
    prompts = random_prompts([3, 20, 45], vocab_size=97)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        # A fixed small KV cache: on a GPU host both engines share the device.
        with LLM(str(tmp_path), executor="uni", dtype="float32", attention_backend=backend,
                 max_num_batched_tokens=32, num_gpu_blocks=64, skip_tokenizer=True) as llm:
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
