"""Draft-model speculation over TP=2 worker processes: each rank runs its shard of the draft,
and the greedy tokens are those of one rank without drafts."""

from strata import LLM, SamplingParams

from model_factory import random_prompts, save_tiny_model, tiny_llama_config

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_tp2_draft_model_tokens_equal_one_rank_without_drafts(tmp_path):
    save_tiny_model(tiny_llama_config(num_key_value_heads=4), tmp_path)
    prompts = random_prompts([7, 30], vocab_size=97)

    def greedy_tokens(**engine_args) -> list[list[int]]:
        with LLM(str(tmp_path), skip_tokenizer=True, dtype="float32", **engine_args) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    draft = {"speculative_method": "draft", "speculative_model": str(tmp_path), "speculative_draft_layers": 1}
    expected = greedy_tokens(executor="uni")
    assert greedy_tokens(executor="mp", tensor_parallel_size=2, **draft) == expected
