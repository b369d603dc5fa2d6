"""Prompt logprobs in the scheduler: every prompt position scored exactly once, by a request
that computes its prompt itself, whatever the prefix cache holds or preemption undoes."""

from strata.engine_core.scheduler import Scheduler, SchedulerConfig
from fake_runner import FakeRunner, fake_prompt_logprob, run_to_completion, step


def make_scheduler(num_blocks: int = 1000, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(**config), num_blocks)


def expected_scores(prompt: list[int]) -> list[tuple[int, int, float]]:
    return [(position, prompt[position], fake_prompt_logprob(position)) for position in range(1, len(prompt))]


def test_every_prompt_position_after_the_first_is_scored_once_across_prefill_chunks(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=7)
    request = make_request(30, max_tokens=3, prompt_logprobs=2)
    scheduler.add_request(request)
    (result,) = run_to_completion(scheduler, FakeRunner(4)).values()
    assert result.prompt_logprobs == expected_scores(request.prompt_token_ids)
    assert len(result.token_ids) == 3


def test_a_request_wanting_prompt_logprobs_ignores_the_prefix_cache(make_request):
    scheduler = make_scheduler()
    runner = FakeRunner(4)
    first = make_request(32, max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    scored = make_request(prompt=first.prompt_token_ids, max_tokens=1, prompt_logprobs=0)
    scheduler.add_request(scored)
    out, _ = step(scheduler, runner, {}, {})
    (new,) = out.new_requests
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (0, 32), "it recomputes the cached prompt"
    plain = make_request(prompt=first.prompt_token_ids, max_tokens=1)
    scheduler.add_request(plain)
    out, _ = step(scheduler, runner, {}, {})
    assert out.new_requests[0].num_computed_tokens == 28, "a request without prompt logprobs still hits"


def test_a_request_preempted_inside_its_prompt_sends_each_position_once(make_request):
    # 10 blocks of 4 slots: the first request's decode outgrows the pool while the second
    # is still in its prompt, which is preempted and later computed again from the start.
    scheduler = make_scheduler(num_blocks=10, max_num_batched_tokens=8)
    runner = FakeRunner(4)
    scheduler.add_request(make_request(8, max_tokens=30))
    scored = make_request(32, max_tokens=2, prompt_logprobs=1)
    scheduler.add_request(scored)
    tokens, results, received = {}, {}, {}
    while scheduler.num_preemptions == 0:
        step(scheduler, runner, tokens, results, received)
    assert 0 < len(received[scored.request_id]) < 31, "preempted inside its prompt"
    while scheduler.has_work():
        step(scheduler, runner, tokens, results, received)
    assert results[scored.request_id].prompt_logprobs == expected_scores(scored.prompt_token_ids)


def test_a_request_resumed_after_its_prompt_was_scored_no_longer_asks_for_prompt_logprobs(make_request):
    scheduler = make_scheduler(num_blocks=14, max_num_batched_tokens=64)
    runner = FakeRunner(4)
    scheduler.add_request(make_request(20, max_tokens=30, prompt_logprobs=1))
    scheduler.add_request(make_request(20, max_tokens=30))
    resumed = []
    while scheduler.has_work():
        out, _ = step(scheduler, runner, {}, {})
        resumed += [new for new in out.new_requests if new.output_token_ids]
    assert resumed, "the pool is too small for both: one must be preempted after its prompt"
    assert all(new.sampling_params.prompt_logprobs is None for new in resumed)


def test_max_tokens_zero_computes_the_prompt_and_finishes_without_a_token(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request(20, max_tokens=0, prompt_logprobs=0)
    scheduler.add_request(request)
    (result,) = run_to_completion(scheduler, FakeRunner(4)).values()
    assert (result.token_ids, result.finish_reason) == ([], "length")
    assert result.prompt_logprobs == expected_scores(request.prompt_token_ids)
    assert scheduler.kv.usage == 0
