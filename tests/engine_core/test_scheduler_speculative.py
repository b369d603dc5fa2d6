"""Speculative decoding in the scheduler, driven by the fake runner (which verifies drafts as a
worker does): the tokens equal decoding without drafts, drafts count against the budget and
get KV slots, rejected drafts give their slots back, and nothing passes a stop."""

from strata.engine_core.speculative import SpeculativeConfig
from strata.engine_core.protocol import pack_tokens, unpack_tokens
from strata.engine_core.scheduler import Scheduler, SchedulerConfig
from fake_runner import FakeRunner, run_to_completion, step

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
PATTERN = [11, 12, 13, 14, 15]


def make_scheduler(speculative: SpeculativeConfig = NGRAM, num_blocks: int = 1000, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    config.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(speculative=speculative, **config), num_blocks)


def repeating_runner(request_ids: list[str], length: int = 60) -> FakeRunner:
    """A runner whose requests keep writing the pattern their prompt repeats: n-gram drafts hit."""
    runner = FakeRunner(4)
    for request_id in request_ids:
        runner.forced_tokens[request_id] = (PATTERN * (length // len(PATTERN) + 1))[:length]
    return runner


def test_tokens_are_the_same_with_and_without_drafts(make_request):
    def run(speculative: SpeculativeConfig) -> tuple[dict, Scheduler]:
        scheduler = make_scheduler(speculative)
        ids = [f"r{i}" for i in range(4)]
        for i, request_id in enumerate(ids):
            prompt = PATTERN * 3 if i % 2 == 0 else [100 + i] * 7 + [3, 4, 5]
            scheduler.add_request(make_request(prompt=prompt, request_id=request_id, max_tokens=40))
        runner = repeating_runner(ids[:2])  # the other two write what the fake model makes up
        return run_to_completion(scheduler, runner), scheduler

    plain, _ = run(SpeculativeConfig())
    speculated, scheduler = run(NGRAM)
    assert {k: v.token_ids for k, v in speculated.items()} == {k: v.token_ids for k, v in plain.items()}
    assert scheduler.spec.accepted_tokens > 0 and scheduler.spec.draft_tokens > scheduler.spec.accepted_tokens


def test_accepted_drafts_cut_the_steps_a_repetitive_request_takes(make_request):
    def steps(speculative: SpeculativeConfig) -> int:
        scheduler = make_scheduler(speculative)
        scheduler.add_request(make_request(prompt=PATTERN * 3, request_id="r", max_tokens=40))
        runner, count = repeating_runner(["r"]), 0
        while scheduler.has_work():
            step(scheduler, runner, {}, {})
            count += 1
        return count

    assert steps(NGRAM) * 3 <= steps(SpeculativeConfig()) + 3  # 1 prefill + 40 decodes, against ~1 + 10


def test_drafts_count_against_the_token_budget(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=6)
    for i in range(3):
        scheduler.add_request(make_request(prompt=PATTERN * 2, request_id=f"r{i}", max_tokens=30))
    runner = repeating_runner(["r0", "r1", "r2"])
    while scheduler.has_work():
        out, _ = step(scheduler, runner, {}, {})
        assert out.total_num_scheduled_tokens <= 6


def test_a_stop_token_among_accepted_drafts_ends_the_request_there(make_request):
    scheduler = make_scheduler()
    request = make_request(prompt=PATTERN * 3, request_id="r", max_tokens=40, eos_token_id=13)
    scheduler.add_request(request)
    runner = repeating_runner(["r"])
    (result,) = run_to_completion(scheduler, runner).values()
    assert result.token_ids == [11, 12, 13] and result.finish_reason == "stop"


def test_max_tokens_is_never_passed_by_accepted_drafts(make_request):
    for max_tokens in range(1, 12):
        scheduler = make_scheduler()
        scheduler.add_request(make_request(prompt=PATTERN * 3, request_id="r", max_tokens=max_tokens))
        (result,) = run_to_completion(scheduler, repeating_runner(["r"])).values()
        assert result.token_ids == (PATTERN * 3)[:max_tokens]


def test_rejected_drafts_give_back_the_blocks_only_they_used(make_request):
    scheduler = make_scheduler(SpeculativeConfig(method="ngram", num_speculative_tokens=8))
    request = make_request(prompt=[7, 20, 21, 22, 23, 24, 25, 26, 27, 3, 4], request_id="r", max_tokens=20)
    scheduler.add_request(request)
    runner = FakeRunner(4)
    runner.forced_tokens["r"] = [7] + [1000 + i for i in range(19)]  # drafts 20..27 after the 7, all wrong
    step(scheduler, runner, {}, {})
    out, _ = step(scheduler, runner, {}, {})
    assert len(out.cached.draft_token_ids) == 1 and out.total_num_scheduled_tokens == 9
    assert len(request.all_token_ids) == 13
    assert len(scheduler.kv.get_block_ids("r")) == 4, "the fifth block held only rejected drafts"


def test_workers_cut_their_tables_where_rejected_drafts_gave_blocks_back(make_request):
    scheduler = make_scheduler(SpeculativeConfig(method="ngram", num_speculative_tokens=8))
    request = make_request(prompt=[7, 20, 21, 22, 23, 24, 25, 26, 27, 3, 4], request_id="r", max_tokens=20)
    scheduler.add_request(request)
    runner = FakeRunner(4)
    runner.forced_tokens["r"] = [7] + [1000 + i for i in range(19)]  # every draft wrong
    for _ in range(2):
        step(scheduler, runner, {}, {})
    out, _ = step(scheduler, runner, {}, {})  # step() also checks every table against the scheduler's
    assert out.cached.kept_blocks == {request.handle: 4}
    assert runner.rows[request.handle].block_ids[:4] == scheduler.kv.get_block_ids("r")[:4]


def test_preemption_and_abort_around_speculated_steps_keep_the_kv_invariants(make_request):
    scheduler = make_scheduler(num_blocks=24, max_num_batched_tokens=16)
    ids = [f"r{i}" for i in range(6)]
    for request_id in ids:
        scheduler.add_request(make_request(prompt=PATTERN * 2, request_id=request_id, max_tokens=30))
    runner, tokens, results = repeating_runner(ids), {}, {}
    for count in range(400):
        if count == 5:
            scheduler.abort_requests(["r1"])
        step(scheduler, runner, tokens, results)  # checks the invariants after each step
        if not scheduler.has_work():
            break
    assert scheduler.num_preemptions > 0
    assert all(results[r].token_ids == (PATTERN * 6)[:30] for r in ids if r != "r1")


DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="draft-dir")


def test_drafts_the_workers_propose_are_scheduled_in_the_request_next_step(make_request):
    scheduler = make_scheduler(DRAFT)
    scheduler.add_request(make_request(prompt=PATTERN * 2, request_id="r", max_tokens=20, temperature=0))
    runner = repeating_runner(["r"])
    out = scheduler.schedule()
    result = runner.execute(out)
    result.draft_token_ids = {0: pack_tokens([12, 13, 14])}  # the draft model's guesses after "11"
    scheduler.update_from_output(out, result)
    out, _ = step(scheduler, runner, {}, {})
    assert [unpack_tokens(packed).tolist() for packed in out.cached.draft_token_ids.values()] == [[12, 13, 14]]
    assert scheduler.spec.accepted_tokens == 3


def test_a_step_with_more_running_requests_than_the_limit_verifies_no_drafts(make_request):
    limited = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3, disable_by_batch_size=2)
    scheduler = make_scheduler(limited)
    ids = ["r0", "r1", "r2"]
    for request_id in ids:
        scheduler.add_request(make_request(prompt=PATTERN * 3, request_id=request_id, max_tokens=12))
    runner = repeating_runner(ids)
    for _ in range(6):  # the prefill, then decode steps of three requests
        out, _ = step(scheduler, runner, {}, {})
        assert not out.cached.draft_token_ids and not out.propose_drafts
    assert len(scheduler.running) == 3 and scheduler.spec.draft_tokens == 0
    scheduler.abort_requests(["r2"])
    out, _ = step(scheduler, runner, {}, {})
    assert out.cached.draft_token_ids and out.propose_drafts  # two left: within the limit again
