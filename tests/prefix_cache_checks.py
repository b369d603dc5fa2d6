"""One scenario every executor must pass: ``LLM.reset_prefix_cache`` makes the engine forget the
prompts it has seen, and changes nothing else."""

from strata import LLM, SamplingParams
from strata.runtime.engine_args import CPU_BLOCK_SIZE

PROMPT = list(range(100, 100 + 4 * CPU_BLOCK_SIZE))  # four full blocks
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prefix_hit_tokens_of_one_run(llm: LLM) -> tuple[int, list[int]]:
    """Prompt tokens the prefix cache served to one run of ``PROMPT``, and its output."""
    before = llm.stats.prefix_cache_hits if llm.stats else 0
    [output] = llm.generate(PROMPT, ONE_TOKEN, use_tqdm=False)
    return llm.stats.prefix_cache_hits - before, output.outputs[0].token_ids


def check_reset_prefix_cache_forgets_seen_prompts(llm: LLM) -> None:
    first_hits, first_tokens = prefix_hit_tokens_of_one_run(llm)
    assert first_hits == 0
    repeat_hits, repeat_tokens = prefix_hit_tokens_of_one_run(llm)
    assert repeat_hits >= 3 * CPU_BLOCK_SIZE, "the repeated prompt should have hit the cache"
    llm.reset_prefix_cache()
    after_reset_hits, after_reset_tokens = prefix_hit_tokens_of_one_run(llm)
    assert after_reset_hits == 0
    assert first_tokens == repeat_tokens == after_reset_tokens
