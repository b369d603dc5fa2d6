"""Scheduler scenarios, one behaviour each, driven by a fake runner that keeps a real
persistent batch from the per-step diffs."""

from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.protocol import KVConnectorOutput, ModelRunnerOutput, unpack_handles
from strata.engine_core.request import RequestStatus
from strata.engine_core.scheduler import Scheduler, SchedulerConfig
from fake_runner import FakeRunner, run_to_completion, step


def make_scheduler(num_blocks: int = 1000, connector=None, **config) -> Scheduler:
    config.setdefault("block_size", 16)
    config.setdefault("max_model_len", 8192)
    return Scheduler(SchedulerConfig(**config), num_blocks, connector)


def scheduled_tokens(out) -> dict[int, int]:
    """handle -> tokens scheduled this step."""
    counts = {new.handle: new.num_scheduled_tokens for new in out.new_requests}
    for handle in unpack_handles(out.cached.handles):
        counts[handle] = out.cached.num_tokens.get(handle, 1)
    return counts


def test_long_prompt_is_chunked_to_the_budget_across_steps(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=512)
    runner = FakeRunner(16)
    scheduler.add_request(make_request(5000, max_tokens=2))
    chunks, tokens, results = [], {}, {}
    while scheduler.has_work():
        out, outputs = step(scheduler, runner, tokens, results)
        chunks.append(out.total_num_scheduled_tokens)
        if sum(chunks) < 5000:
            assert outputs.new_token_ids == [], "a partial prefill chunk produced a token"
    assert chunks[:10] == [512] * 9 + [5000 - 9 * 512]
    assert chunks[10:] == [1]
    (result,) = results.values()
    assert len(result.token_ids) == 2


def test_a_prompts_last_token_chunked_alone_counts_as_prefilled(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request(9, max_tokens=1))
    run_to_completion(scheduler, FakeRunner(16))
    assert scheduler.prompt_tokens_computed == 9


def test_decode_batch_schedules_one_token_per_running_request(make_request):
    scheduler = make_scheduler()
    runner = FakeRunner(16)
    for _ in range(8):
        scheduler.add_request(make_request(30, max_tokens=5))
    out, _ = step(scheduler, runner, {}, {})
    assert len(out.new_requests) == 8
    out, outputs = step(scheduler, runner, {}, {})
    assert out.new_requests == []
    assert set(scheduled_tokens(out).values()) == {1}
    assert len(outputs.new_token_ids) == 8 and out.total_num_scheduled_tokens == 8


def test_prefill_and_decodes_share_one_step(make_request):
    scheduler = make_scheduler(max_num_batched_tokens=100)
    runner = FakeRunner(16)
    scheduler.add_request(make_request(40, max_tokens=10))
    scheduler.add_request(make_request(40, max_tokens=10))
    step(scheduler, runner, {}, {})
    scheduler.add_request(make_request(300, max_tokens=10))
    out, _ = step(scheduler, runner, {}, {})
    counts = sorted(scheduled_tokens(out).values())
    assert counts == [1, 1, 98], "two decodes plus a prefill chunk filling the rest of the budget"


def test_preempted_requests_resume_and_produce_the_same_tokens(make_request):
    def run(num_blocks: int) -> tuple[dict, int]:
        scheduler = make_scheduler(num_blocks, block_size=4, max_num_batched_tokens=64)
        for i in range(6):
            scheduler.add_request(make_request(prompt=[i + 3] * 10, request_id=f"r{i}", max_tokens=30))
        return run_to_completion(scheduler, FakeRunner(4)), scheduler.num_preemptions

    unconstrained, no_preemptions = run(1000)
    constrained, preemptions = run(14)
    assert no_preemptions == 0 and preemptions > 0
    assert {k: v.token_ids for k, v in constrained.items()} == {k: v.token_ids for k, v in unconstrained.items()}
    assert all(len(r.token_ids) == 30 and r.finish_reason == "length" for r in constrained.values())


def test_prefix_of_a_finished_request_is_a_cache_hit(make_request):
    scheduler = make_scheduler()
    runner = FakeRunner(16)
    prompt = list(range(3, 53))  # 50 tokens: three full blocks
    scheduler.add_request(make_request(prompt=prompt, max_tokens=3))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request(prompt=prompt + [7, 8], max_tokens=3))
    out = scheduler.schedule()
    assert out.new_requests[0].num_computed_tokens == 48
    assert out.new_requests[0].num_scheduled_tokens == 4
    assert scheduler.stats().prefix_cache_hits == 48


def test_prefix_cache_lookup_counts_once_however_often_admission_is_retried(make_request):
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    first, second = make_request(16, max_tokens=6), make_request(16, max_tokens=6)
    scheduler.add_request(first)
    scheduler.add_request(second)
    steps_second_waited = 0
    runner, tokens, results = FakeRunner(4), {}, {}
    while scheduler.has_work():
        step(scheduler, runner, tokens, results)
        steps_second_waited += second.status == RequestStatus.WAITING
    assert steps_second_waited > 2, "the scenario must make the second request retry admission"
    assert scheduler.stats().prefix_cache_queries == 16 + 16


def test_prefix_cache_lookup_is_not_counted_again_on_resumption(make_request):
    scheduler = make_scheduler(14, block_size=4, max_num_batched_tokens=64)
    for i in range(6):
        scheduler.add_request(make_request(prompt=[i + 3] * 10, max_tokens=30))
    run_to_completion(scheduler, FakeRunner(4))
    assert scheduler.num_preemptions > 0
    assert scheduler.stats().prefix_cache_queries == 6 * 10


def test_requests_with_different_cache_salts_share_no_block(make_request):
    scheduler = make_scheduler()
    runner = FakeRunner(16)
    prompt = list(range(3, 53))  # three full blocks
    scheduler.add_request(make_request(prompt=prompt, max_tokens=3, cache_salt="tenant-a"))
    run_to_completion(scheduler, runner)
    for salt, expected_hit in [("tenant-b", 0), (None, 0), ("tenant-a", 48)]:
        scheduler.add_request(make_request(prompt=prompt, max_tokens=3, cache_salt=salt))
        assert scheduler.schedule().new_requests[0].num_computed_tokens == expected_hit, salt
        run_to_completion(scheduler, runner)


def test_whole_prompt_hit_still_computes_the_last_token(make_request):
    scheduler = make_scheduler()
    runner = FakeRunner(16)
    prompt = list(range(3, 35))  # exactly two blocks
    scheduler.add_request(make_request(prompt=prompt, max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request(prompt=prompt, max_tokens=1))
    new = scheduler.schedule().new_requests[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (16, 16)


def test_abort_frees_blocks_and_is_reported_to_workers_once(make_request):
    scheduler = make_scheduler()
    runner = FakeRunner(16)
    request = make_request(100, max_tokens=50)
    scheduler.add_request(request)
    step(scheduler, runner, {}, {})
    handle = request.handle
    assert scheduler.kv.num_free_blocks < scheduler.kv.num_blocks
    scheduler.abort_requests([request.request_id])
    scheduler.abort_requests([request.request_id, "never-existed"])
    assert scheduler.kv.req_to_blocks == {}
    out, outputs = step(scheduler, runner, {}, {})
    assert out.finished_handles == [handle]
    assert [f.finish_reason for f in outputs.finished] == ["abort"]
    assert scheduler.schedule().finished_handles == []
    scheduler.check_invariants()


def test_prompt_longer_than_max_model_len_is_rejected_at_once(make_request):
    scheduler = make_scheduler(max_model_len=64)
    scheduler.add_request(make_request(65))
    results = run_to_completion(scheduler, FakeRunner(16), max_steps=1)
    (result,) = results.values()
    assert result.finish_reason == "error" and "max_model_len" in result.message


def test_prompt_needing_more_blocks_than_the_pool_is_rejected_at_once(make_request):
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request(65))
    (result,) = run_to_completion(scheduler, FakeRunner(16), max_steps=1).values()
    assert result.finish_reason == "error" and "KV blocks" in result.message


def test_request_that_outgrows_the_whole_cache_alone_ends_with_error(make_request):
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add_request(make_request(10, max_tokens=100, ignore_eos=True))
    (result,) = run_to_completion(scheduler, FakeRunner(4)).values()
    assert result.finish_reason == "error" and "even alone" in result.message
    assert len(result.token_ids) == 16 - 10 + 1, "the token sampled from the last slot still counts"


def test_priority_policy_runs_lower_values_first_ties_by_arrival(make_request):
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    for request_id, priority, arrival in [("c", 5, 0.0), ("a", 1, 2.0), ("b", 1, 3.0), ("z", 0, 9.0)]:
        scheduler.add_request(make_request(request_id=request_id, priority=priority, arrival_time=arrival, max_tokens=1))
    order = []
    runner = FakeRunner(16)
    while scheduler.has_work():
        out, _ = step(scheduler, runner, {}, {})
        order += [new.request_id for new in out.new_requests]
    assert order == ["z", "a", "b", "c"]


def test_fcfs_preempts_the_latest_arrival(make_request):
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    first, second = make_request(8, max_tokens=20), make_request(8, max_tokens=20)
    scheduler.add_request(first)
    scheduler.add_request(second)
    runner = FakeRunner(4)
    while first.num_preemptions + second.num_preemptions == 0:
        step(scheduler, runner, {}, {})
    assert (first.num_preemptions, second.num_preemptions) == (0, 1)
    assert second.status == RequestStatus.PREEMPTED


def test_starved_waiting_request_preempts_a_running_one(make_request):
    scheduler = make_scheduler(max_num_seqs=2, starvation_steps=5)
    runner = FakeRunner(16)
    long_a, long_b = make_request(10, max_tokens=200), make_request(10, max_tokens=200)
    starving = make_request(10, max_tokens=2)
    for request in (long_a, long_b, starving):
        scheduler.add_request(request)
    steps = 0
    results: dict = {}
    while starving.request_id not in results:
        step(scheduler, runner, {}, results)
        steps += 1
    assert steps < 20, "the starvation guard let the request wait for the long ones"
    assert long_b.num_preemptions == 1 and long_a.num_preemptions == 0


def test_stop_rules_eos_stop_ids_min_tokens_and_ignore_eos(make_request):
    scheduler = make_scheduler()
    runner = FakeRunner(16)
    cases = {
        "eos": dict(eos_token_id=2, max_tokens=10),
        "stop-id": dict(stop_token_ids=[5], max_tokens=10),
        "min-tokens": dict(eos_token_id=2, min_tokens=3, max_tokens=10),
        "ignore-eos": dict(eos_token_id=2, ignore_eos=True, max_tokens=4),
    }
    for request_id, params in cases.items():
        scheduler.add_request(make_request(5, request_id=request_id, **params))
        runner.forced_tokens[request_id] = [9, 2, 5, 2, 2, 2, 2, 2, 2, 2]
    results = run_to_completion(scheduler, runner)
    assert (results["eos"].token_ids, results["eos"].finish_reason) == ([9, 2], "stop")
    assert (results["stop-id"].token_ids, results["stop-id"].finish_reason) == ([9, 2, 5], "stop")
    assert (results["min-tokens"].token_ids, results["min-tokens"].finish_reason) == ([9, 2, 5, 2], "stop")
    assert (results["ignore-eos"].token_ids, results["ignore-eos"].finish_reason) == ([9, 2, 5, 2], "length")


def test_generation_stops_at_max_model_len(make_request):
    scheduler = make_scheduler(max_model_len=24)
    scheduler.add_request(make_request(20, max_tokens=100))
    (result,) = run_to_completion(scheduler, FakeRunner(16)).values()
    assert (len(result.token_ids), result.finish_reason) == (4, "length")


class AsyncLoadConnector(SchedulerConnector):
    """Claims ``num_tokens`` more tokens for every new request, loaded asynchronously."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.allocated: dict[str, tuple[list[int], int]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return min(self.num_tokens, request.num_tokens - 1 - num_computed_tokens), True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)


def test_async_load_waits_for_kv_then_runs_with_computed_tokens_advanced(make_request):
    connector = AsyncLoadConnector(32)
    scheduler = make_scheduler(connector=connector)
    runner = FakeRunner(16)
    request = make_request(40, max_tokens=2)
    scheduler.add_request(request)
    for _ in range(3):
        out, _ = step(scheduler, runner, {}, {})
        assert out.new_requests == [] and request.status == RequestStatus.WAITING_FOR_KV
    assert connector.allocated[request.request_id] == (scheduler.kv.get_block_ids(request.request_id), 32)
    out = scheduler.schedule()
    done = ModelRunnerOutput(out.step, kv_connector_output=KVConnectorOutput(finished_recving=[request.request_id]))
    scheduler.update_from_output(out, done)
    out = scheduler.schedule()
    assert [(n.num_computed_tokens, n.num_scheduled_tokens) for n in out.new_requests] == [(32, 8)]
    assert request.status == RequestStatus.RUNNING


class DelayedFreeConnector(SchedulerConnector):
    def request_finished(self, request, block_ids):
        return f"store-{request.request_id}"


def test_connector_can_hold_blocks_until_its_store_finishes(make_request):
    scheduler = make_scheduler(connector=DelayedFreeConnector())
    runner = FakeRunner(16)
    request = make_request(40, max_tokens=1)
    scheduler.add_request(request)
    step(scheduler, runner, {}, {})
    assert request.finished and scheduler.kv.num_free_blocks < scheduler.kv.num_blocks
    scheduler.check_invariants()
    out = scheduler.schedule()
    stored = ModelRunnerOutput(out.step, kv_connector_output=KVConnectorOutput(finished_sending=[f"store-{request.request_id}"]))
    scheduler.update_from_output(out, stored)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    scheduler.check_invariants()


class FlushOnPreemptConnector(SchedulerConnector):
    """Holds a preempted request's blocks until its (pretend) store to the CPU tier finishes."""

    def request_preempted(self, request, block_ids):
        return f"flush-{request.request_id}"


def test_requests_wait_for_a_held_victims_blocks_instead_of_preempting_more(make_request):
    scheduler = make_scheduler(num_blocks=6, block_size=4, connector=FlushOnPreemptConnector())
    runner = FakeRunner(4)
    first, second, third = (make_request(8, max_tokens=20) for _ in range(3))
    for request in (first, second, third):
        scheduler.add_request(request)
    step(scheduler, runner, {}, {})  # three prefills fill the pool: two blocks each
    out, _ = step(scheduler, runner, {}, {})  # every decode needs a third block
    assert out.preempted_handles and scheduler.num_preemptions == 1
    assert third.status == RequestStatus.PREEMPTED
    assert first.status == second.status == RequestStatus.RUNNING
    assert scheduled_tokens(out) == {}, "the two left should wait for the held blocks"
    out = scheduler.schedule()  # the flush finishes during this step
    flushed = runner.execute(out)
    flushed.kv_connector_output = KVConnectorOutput(finished_sending=[f"flush-{third.request_id}"])
    scheduler.update_from_output(out, flushed)
    out, _ = step(scheduler, runner, {}, {})
    assert len(scheduled_tokens(out)) == 2 and scheduler.num_preemptions == 1
    scheduler.check_invariants()
