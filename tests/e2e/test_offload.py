"""The CPU offload tier changes how much is computed, never what is generated."""

import random

import pytest

from strata import LLM, SamplingParams

from conftest import save_tiny_model_with_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OFFLOAD_BYTES = 512 * 1024 * 1024
# The tiny Llama's float32 cache with 4-token blocks: 2 layers x (K, V) x 4 x 2 heads x 16 dims.
TINY_BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4


def documents(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_path) -> str:
    """A tiny random Llama with a long context: the tests count tokens, they need no real model."""
    path = tmp_path_factory.mktemp("tiny-long")
    save_tiny_model_with_tokenizer("llama", path, default_model_path, max_position_embeddings=2048)
    return str(path)


def run_rounds(model: str, prompts_by_round, params=GREEDY, **engine_args):
    """Send each round's prompts in turn; return the tokens and the engine's final stats."""
    with LLM(model, executor="uni", dtype="float32", **engine_args) as llm:
        tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                  for prompts in prompts_by_round]
        return tokens, llm.stats


def test_long_context_reuse_computes_3x_fewer_prefill_tokens_with_the_same_output(tiny_model):
    # Two 1,024-token documents asked about in alternation, 4 rounds (8 requests). The GPU pool
    # (80 blocks of 16) holds about one document, so each request evicts the other document.
    doc_a, doc_b = documents(2, 1024)
    questions = documents(8, 16, seed=1)
    rounds = [[(doc_a if i % 2 == 0 else doc_b) + questions[i]] for i in range(8)]
    pool = {"block_size": 16, "num_gpu_blocks": 80}
    without, stats_off = run_rounds(tiny_model, rounds, **pool)
    with_offload, stats_on = run_rounds(tiny_model, rounds, **pool, kv_offload_cpu_bytes=OFFLOAD_BYTES)
    assert with_offload == without
    assert stats_on.offload_hit_tokens > 0
    assert stats_off.prompt_tokens_computed >= 3 * stats_on.prompt_tokens_computed


def test_preemption_with_offload_gives_the_same_tokens(tiny_model):
    prompts = documents(6, 100)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = {}
    for offload in (None, OFFLOAD_BYTES):
        (tokens,), stats = run_rounds(
            tiny_model, [prompts], params, block_size=16, num_gpu_blocks=30, kv_offload_cpu_bytes=offload
        )
        results[offload] = tokens
        assert stats.num_preemptions > 0
        if offload:
            assert stats.offload_blocks_loaded > 0, "preempted requests reload their flushed blocks"
    assert results[OFFLOAD_BYTES] == results[None]


def test_stress_many_short_requests_with_aborts_leaves_nothing_pinned_or_leaked(tmp_path, default_model_path):
    """10,000 short requests on a tiny model, a CPU tier small enough to evict all the time, and
    random aborts (some while their blocks are being copied)."""
    save_tiny_model_with_tokenizer("llama", tmp_path, default_model_path)
    rng = random.Random(0)
    llm = LLM(str(tmp_path), executor="uni", dtype="float32", num_gpu_blocks=256, max_num_seqs=128,
              block_size=4, kv_offload_cpu_bytes=50 * TINY_BLOCK_BYTES, max_num_batched_tokens=2048)
    engine = llm.engine
    try:
        core = engine.core
        prefixes = [[rng.randrange(3, 97) for _ in range(12)] for _ in range(20)]
        finished = {}
        submitted = []
        for i in range(10_000):
            prompt = rng.choice(prefixes) + [rng.randrange(3, 97) for _ in range(rng.randrange(1, 8))]
            request_id = f"stress-{i}"
            for request in llm.processor.add_request(request_id, None, prompt, SamplingParams(
                    temperature=0, max_tokens=rng.randrange(1, 6), ignore_eos=True)):
                engine.add_request(request)
            submitted.append(request_id)
            if i % 500 == 499:
                while core.has_work():
                    outputs = engine.get_output()
                    llm.processor.process(outputs)
                    for done in outputs.finished:
                        finished[done.request_id] = done.finish_reason
                    if rng.random() < 0.3:  # abort a few in-flight requests mid-run
                        engine.abort_requests(rng.sample(list(core.scheduler.requests), min(3, len(core.scheduler.requests))))
                    core.scheduler.check_invariants()
        assert set(finished) == set(submitted)
        assert {"length", "abort"} >= set(finished.values()) and "abort" in finished.values()
        connector = core.scheduler.connector
        assert connector.tier.usage > 0.9, "the tier was meant to be full and evicting"
        core.scheduler.check_invariants()
        connector.tier.check_invariants()
        assert connector.tier.num_pinned == 0 and connector.tier.num_in_flight == 0
        assert core.scheduler.kv.held == {} and core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
    finally:
        llm.shutdown()
