"""Speculative decoding with a draft model run by the workers, against the same engine without
drafts: greedy tokens equal for a random draft (few accepted) and for a self-draft of the
target's first layer; a self-draft with all the target's layers has every draft accepted."""

import pytest

from strata import LLM, SamplingParams

from model_factory import random_prompts, save_tiny_model, tiny_llama_config

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts([5, 19, 40], vocab_size=97)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("target")
    save_tiny_model(tiny_llama_config(), path)
    return str(path)


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    return greedy_tokens(target, executor="uni")


def greedy_tokens(model: str, **engine_args) -> list[list[int]]:
    with LLM(model, skip_tokenizer=True, dtype="float32", **engine_args) as llm:
        tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        stats = llm.stats
    if engine_args.get("speculative_method"):
        assert stats.spec_verifications > 0
    return tokens


def test_a_random_draft_leaves_greedy_tokens_unchanged(target, expected, tmp_path):
    # Another architecture's shape (one layer, one KV head) with the target's vocabulary.
    save_tiny_model(tiny_llama_config(num_hidden_layers=1, num_key_value_heads=1), tmp_path, seed=7)
    draft = {"speculative_method": "draft", "speculative_model": str(tmp_path), "num_speculative_tokens": 3}
    assert greedy_tokens(target, executor="uni", **draft) == expected


def test_a_self_draft_of_the_first_layer_leaves_greedy_tokens_unchanged(target, expected):
    draft = {"speculative_method": "draft", "speculative_model": target, "speculative_draft_layers": 1}
    # A small cache (24 blocks of 4 for 136 tokens): drafts past a row's blocks run in scratch
    # blocks, and rows are preempted and resumed.
    with LLM(target, skip_tokenizer=True, dtype="float32", executor="uni", num_gpu_blocks=24, block_size=4, **draft) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert llm.stats.num_preemptions > 0 and llm.stats.spec_accepted_tokens > 0


def test_a_self_draft_with_every_layer_has_every_draft_accepted(target, expected):
    with LLM(target, skip_tokenizer=True, dtype="float32", executor="uni", speculative_method="draft",
             speculative_model=target, num_speculative_tokens=4) as llm:
        tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        stats = llm.stats
    assert tokens == expected
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_a_catch_up_longer_than_the_step_budget_is_spread_over_steps(target, expected):
    # A 16-token budget against prompts of up to 40 tokens: no draft forward may take more, and
    # a row not yet caught up decodes without drafts, so the tokens stay the target's.
    with LLM(target, skip_tokenizer=True, dtype="float32", executor="uni", max_num_batched_tokens=16,
             speculative_method="draft", speculative_model=target, num_speculative_tokens=4) as llm:
        drafter = llm.engine.core.executor.runner.drafter
        forward_sizes = []
        greedy = drafter._greedy

        def counted_greedy(token_ids, *rest):
            forward_sizes.append(len(token_ids))
            return greedy(token_ids, *rest)

        drafter._greedy = counted_greedy
        tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        stats = llm.stats
    assert tokens == expected
    assert max(forward_sizes) == 16
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_seeded_sampled_requests_with_a_self_draft_draw_the_tokens_they_draw_without(target):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    with LLM(target, skip_tokenizer=True, dtype="float32", executor="uni") as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(target, skip_tokenizer=True, dtype="float32", executor="uni", speculative_method="draft",
             speculative_model=target, speculative_draft_layers=1) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == plain
        assert llm.stats.spec_accepted_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused_before_start(target, tmp_path):
    save_tiny_model(tiny_llama_config(vocab_size=101), tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target, skip_tokenizer=True, executor="uni", speculative_method="draft", speculative_model=str(tmp_path))
