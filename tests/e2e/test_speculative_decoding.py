"""Speculative decoding with n-gram drafts against the same engine without: token for token
equal (greedy, and seeded sampling, whose draws are keyed by output position), stop strings
cut at the same place, the CPU offload tier on, and drafts really accepted."""

import json

import pytest

from strata import LLM, SamplingParams
from strata.engine_core.sampling_params import StructuredOutputsParams
from strata.worker.model_loader import gguf_file

from model_factory import save_tiny_model, tiny_llama_config

DOCUMENT = (
    "The scheduler gives each request a number of tokens per step. Running requests go first, "
    "then waiting ones. When blocks run out, the last running request is preempted. "
)
PROMPTS = [
    f"Copy this text exactly.\n\n{DOCUMENT * 2}\nCopy:\n",
    "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Write a short poem about the sea.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48)
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def plain():
    with LLM(executor="uni", dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def speculative():
    with LLM(executor="uni", dtype="float32", **NGRAM) as engine:
        yield engine


def token_ids(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def accepted(llm: LLM) -> int:
    """Drafts the engine accepted so far (no stats before its first step)."""
    return 0 if llm.stats is None else llm.stats.spec_accepted_tokens


def test_greedy_tokens_equal_decoding_without_drafts(plain, speculative):
    assert token_ids(speculative, PROMPTS, GREEDY) == token_ids(plain, PROMPTS, GREEDY)
    stats = speculative.stats
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert sum(stats.spec_accepted_by_position) == stats.spec_accepted_tokens


def test_seeded_sampling_draws_the_same_tokens_as_without_drafts(plain, speculative):
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=seed, max_tokens=32) for seed in (1, 2, 3)]
    assert token_ids(speculative, PROMPTS, params) == token_ids(plain, PROMPTS, params)


def test_a_stop_string_cuts_the_text_where_it_does_without_drafts(plain, speculative):
    free = plain.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = free[20:26]
    assert stop.strip(), "pick a stop string that is really in the text"
    params = SamplingParams(temperature=0, max_tokens=48, stop=[stop])
    cut = speculative.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason) == (free[: free.index(stop)], "stop")


def test_max_tokens_and_eos_are_never_passed(plain, speculative):
    for max_tokens in (1, 2, 5, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        assert token_ids(speculative, PROMPTS[:2], params) == token_ids(plain, PROMPTS[:2], params)


@pytest.mark.parametrize(
    "cache", [{}, {"block_size": 16, "num_gpu_blocks": 12}], ids=["room-for-all", "small-cache-preempts"]
)
def test_tiny_random_model_with_drafts_equals_without(cache, tmp_path, default_model_path):
    # With a small cache, blocks that only rejected drafts used go back to the pool and are
    # soon another request's: the workers must stop writing there (a bug until they were told).
    from transformers import AutoTokenizer

    save_tiny_model(tiny_llama_config(vocab_size=49152), tmp_path)
    AutoTokenizer.from_pretrained(default_model_path).save_pretrained(tmp_path)
    prompts = [[5, 6, 7, 8] * 6, [100, 200, 300] * 5, list(range(40, 70)), [20, 21, 22] * 7]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(tmp_path), executor="uni", dtype="float32") as llm:
        expected = token_ids(llm, prompts, params)
    with LLM(str(tmp_path), executor="uni", dtype="float32", **NGRAM, **cache) as llm:
        assert token_ids(llm, prompts, params) == expected
        assert llm.stats.spec_verifications > 0
        assert llm.stats.num_preemptions > 0 or not cache


def test_drafts_with_the_cpu_offload_tier_on_equal_decoding_without(plain):
    with LLM(executor="uni", dtype="float32", kv_offload_cpu_bytes=64 << 20, **NGRAM) as llm:
        assert token_ids(llm, PROMPTS, GREEDY) == token_ids(plain, PROMPTS, GREEDY)


def test_a_self_draft_of_the_default_model_with_the_offload_tier_on_equals_decoding_without(plain):
    # 27 of its 30 layers: a draft right about half the time on these prompts.
    draft = {"speculative_method": "draft", "speculative_model": gguf_file(None), "speculative_draft_layers": 27}
    with LLM(executor="uni", dtype="float32", kv_offload_cpu_bytes=64 << 20, **draft) as llm:
        assert token_ids(llm, PROMPTS, GREEDY) == token_ids(plain, PROMPTS, GREEDY)
        assert 0 < llm.stats.spec_accepted_tokens < llm.stats.spec_draft_tokens


def test_logprobs_of_each_verified_token_equal_those_without_drafts(plain, speculative):
    params = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, logprobs=2),
    ]
    before = accepted(speculative)
    with_drafts = [o.outputs[0] for o in speculative.generate(PROMPTS[:1] * 2, params, use_tqdm=False)]
    assert accepted(speculative) > before
    without = [o.outputs[0] for o in plain.generate(PROMPTS[:1] * 2, params, use_tqdm=False)]
    for drafted, plain_output in zip(with_drafts, without):
        assert drafted.token_ids == plain_output.token_ids
        assert len(drafted.logprobs) == len(drafted.token_ids)
        for got, expected in zip(drafted.logprobs, plain_output.logprobs):
            assert list(got) == list(expected)
            assert list(got.values()) == pytest.approx(list(expected.values()), abs=2e-3)


def test_constrained_requests_stay_valid_and_equal_decoding_without_drafts(plain, speculative):
    record = '{"name":"Alice Smith","city":"Paris","age":31}'
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "age"],
        "additionalProperties": False,
    }
    prompts = [f"Copy the record.\nRecord: {record}\nCopy: {record}\nRecord: {record}\nCopy:", PROMPTS[1]]
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=json.dumps(schema))),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"( [0-9]+,){3,30}")),
    ]
    before = accepted(speculative)
    drafted = [output.outputs[0] for output in speculative.generate(prompts, params, use_tqdm=False)]
    assert accepted(speculative) > before
    without = [output.outputs[0] for output in plain.generate(prompts, params, use_tqdm=False)]
    assert [output.token_ids for output in drafted] == [output.token_ids for output in without]
    assert set(json.loads(drafted[0].text)) == {"name", "city", "age"}
