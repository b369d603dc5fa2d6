"""``strata bench throughput``: the synthetic workload, and the figures a run reports."""

import pytest
import torch

from strata.launch.llm import LLM
from strata.launch.bench.throughput import CORPUS, Workload, format_result, run, synthetic_prompts

CORPUS_IDS = list(range(1000, 1500))


def is_cyclic_slice(tokens: list[int], corpus: list[int]) -> bool:
    start = corpus.index(tokens[0])
    return tokens == [corpus[(start + i) % len(corpus)] for i in range(len(tokens))]


def test_workload_is_deterministic_for_a_seed():
    workload = Workload(num_prompts=8, input_len_min=10, input_len_max=50, prefix_len=5, seed=3)
    assert synthetic_prompts(CORPUS_IDS, workload) == synthetic_prompts(CORPUS_IDS, workload)
    other_seed = Workload(num_prompts=8, input_len_min=10, input_len_max=50, prefix_len=5, seed=4)
    assert synthetic_prompts(CORPUS_IDS, other_seed) != synthetic_prompts(CORPUS_IDS, workload)


def test_prompt_lengths_are_within_bounds_and_vary():
    prompts = synthetic_prompts(CORPUS_IDS, Workload(num_prompts=200, input_len_min=20, input_len_max=40))
    lengths = [len(prompt) for prompt in prompts]
    assert min(lengths) >= 20 and max(lengths) <= 40
    assert len(set(lengths)) > 10


def test_prompts_are_distinct_slices_of_the_corpus_even_past_its_end():
    prompts = synthetic_prompts(CORPUS_IDS, Workload(num_prompts=50, input_len_min=400, input_len_max=600))
    assert all(is_cyclic_slice(prompt, CORPUS_IDS) for prompt in prompts)
    assert len({prompt[0] for prompt in prompts}) == len(prompts), "each prompt starts at its own position"


def test_every_prompt_starts_with_the_same_prefix_then_its_own_part():
    prompts = synthetic_prompts(CORPUS_IDS, Workload(num_prompts=6, input_len_min=8, input_len_max=8, prefix_len=32))
    prefix = prompts[0][:32]
    assert is_cyclic_slice(prefix, CORPUS_IDS)
    assert all(len(prompt) == 40 and prompt[:32] == prefix for prompt in prompts)
    assert len({tuple(prompt[32:]) for prompt in prompts}) == len(prompts)


@pytest.mark.parametrize(
    "fields",
    [{"num_prompts": 0}, {"input_len_min": 0}, {"input_len_min": 9, "input_len_max": 8}, {"output_len": 0},
     {"prefix_len": -1}],
)
def test_workload_rejects_impossible_settings(fields):
    with pytest.raises(ValueError):
        Workload(**fields)


@pytest.fixture(scope="module")
def llm():
    """An engine on one torch thread: these tests time nothing, and on a shared machine a second
    thread mostly waits. The process's thread count is restored afterwards."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        engine = LLM(executor="uni")
    with engine:
        yield engine
    torch.set_num_threads(threads)


def test_corpus_holds_more_tokens_than_the_default_workload_has_prompts(llm):
    assert len(llm.tokenizer.encode(CORPUS, add_special_tokens=False)) >= Workload().num_prompts


def test_run_reports_consistent_figures_against_hf(llm):
    workload = Workload(num_prompts=4, input_len_min=16, input_len_max=32, output_len=8, prefix_len=4)
    result = run(llm, workload, baseline="hf")
    corpus = llm.tokenizer.encode(CORPUS, add_special_tokens=False)
    input_tokens = sum(len(prompt) for prompt in synthetic_prompts(corpus, workload))
    assert result["input_tokens"] == input_tokens
    assert result["output_tokens"] == 4 * 8
    elapsed = result["elapsed_s"]
    assert result["requests_per_s"] == pytest.approx(4 / elapsed)
    assert result["output_tokens_per_s"] == pytest.approx(32 / elapsed)
    assert result["total_tokens_per_s"] == pytest.approx((input_tokens + 32) / elapsed)
    assert result["baseline_output_tokens_per_s"] == pytest.approx(32 / result["baseline_elapsed_s"])
    assert result["ratio"] == pytest.approx(result["output_tokens_per_s"] / result["baseline_output_tokens_per_s"])
    assert (result["executor"], result["tensor_parallel_size"], result["kv_cache_dtype"]) == ("uni", 1, "auto")
    assert result["dtype"] in ("bfloat16", "float32")
    assert f"engine/hf = {result['ratio']:.2f}x" in format_result(result)


def test_run_without_baseline_reports_no_ratio(llm):
    result = run(llm, Workload(num_prompts=2, input_len_min=8, input_len_max=8, output_len=2))
    assert "ratio" not in result and "baseline_output_tokens_per_s" not in result
    assert result["output_tokens"] == 4
    assert "hf" not in format_result(result)


def test_run_with_ngram_drafts_reports_their_acceptance():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        engine = LLM(executor="uni", speculative_method="ngram")
    with engine:
        result = run(engine, Workload(num_prompts=2, input_len_min=64, input_len_max=64, output_len=24))
    drafts, accepted = result["spec_draft_tokens"], result["spec_accepted_tokens"]
    assert 0 <= accepted <= drafts and result["spec_acceptance"] == (accepted / drafts if drafts else 0.0)
    assert result["spec_tokens_per_verification"] >= 1
    assert "drafts accepted" in format_result(result)
