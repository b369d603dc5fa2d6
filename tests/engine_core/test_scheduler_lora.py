"""LoRA adapters in the scheduler: slots in the workers' pool, waiting for one, and prefix-cache
isolation between adapters. The fake runner checks every step that no slot is reloaded while a
row uses it and that each row's slot holds its request's adapter."""

import random

from strata.engine_core.protocol import LoRAAdapter
from strata.engine_core.scheduler import Scheduler, SchedulerConfig
from fake_runner import FakeRunner, run_to_completion, step

A, B, C = (LoRAAdapter(name, lora_id, f"/adapters/{name}") for lora_id, name in enumerate("abc", 1))


def make_scheduler(max_loras: int = 2, num_blocks: int = 1000, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=16, max_model_len=4096, max_loras=max_loras, **config), num_blocks)


def loads(out) -> list[tuple[int, str]]:
    return [(load.slot, load.adapter.name) for load in out.lora_loads]


def test_requests_of_one_adapter_share_its_slot_and_load_it_once(make_request):
    scheduler, runner = make_scheduler(), FakeRunner(16)
    for _ in range(3):
        scheduler.add_request(make_request(20, lora=A, max_tokens=4))
    scheduler.add_request(make_request(20, max_tokens=4))
    out, _ = step(scheduler, runner, {}, {})
    assert loads(out) == [(0, "a")]
    assert sorted(new.lora_slot for new in out.new_requests) == [-1, 0, 0, 0]
    results = run_to_completion(scheduler, runner)
    assert len(results) == 4 and all(r.finish_reason == "length" for r in results.values())


def test_an_idle_slot_keeps_its_adapter_for_the_next_request(make_request):
    scheduler, runner = make_scheduler(), FakeRunner(16)
    scheduler.add_request(make_request(20, lora=A, max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request(20, lora=A, max_tokens=2))
    out, _ = step(scheduler, runner, {}, {})
    assert out.lora_loads == [] and out.new_requests[0].lora_slot == 0


def test_the_slot_idle_longest_changes_adapter(make_request):
    scheduler, runner = make_scheduler(max_loras=2), FakeRunner(16)
    for adapter in (A, B, A):  # a into slot 0, b into slot 1, then a used again: b is older
        scheduler.add_request(make_request(20, lora=adapter, max_tokens=2))
        run_to_completion(scheduler, runner)
    scheduler.add_request(make_request(20, lora=C, max_tokens=2))
    out, _ = step(scheduler, runner, {}, {})
    assert loads(out) == [(1, "c")]
    assert scheduler.lora_slots.adapters == [A, C]


def test_a_request_waits_for_a_slot_while_others_run_and_starts_when_one_frees(make_request):
    scheduler, runner = make_scheduler(max_loras=1), FakeRunner(16)
    scheduler.add_request(make_request(20, lora=A, max_tokens=3, request_id="a-first"))
    scheduler.add_request(make_request(20, lora=B, max_tokens=3, request_id="b"))
    scheduler.add_request(make_request(20, max_tokens=3, request_id="base"))
    scheduler.add_request(make_request(20, lora=A, max_tokens=3, request_id="a-second"))
    tokens, results = {}, {}
    out, _ = step(scheduler, runner, tokens, results)
    assert {new.request_id for new in out.new_requests} == {"a-first", "base", "a-second"}
    started_at, steps = {}, 1
    while scheduler.has_work():
        out, _ = step(scheduler, runner, tokens, results)
        steps += 1
        for new in out.new_requests:
            started_at[new.request_id] = steps
    assert started_at == {"b": 4}  # once both requests of a finished their 3 tokens
    assert {request_id: len(r.token_ids) for request_id, r in results.items()} == dict.fromkeys(
        ["a-first", "b", "base", "a-second"], 3
    )
    assert scheduler.lora_slots.adapters == [B]


def test_a_step_never_holds_more_adapters_than_slots(make_request):
    rng = random.Random(7)
    adapters = [LoRAAdapter(f"x{i}", i + 1, "/x") for i in range(5)]
    scheduler, runner = make_scheduler(max_loras=2, max_num_batched_tokens=128), FakeRunner(16)
    expected = {}
    for i in range(40):
        request = make_request(rng.randint(5, 60), lora=rng.choice([None, *adapters]), max_tokens=rng.randint(1, 12))
        expected[request.request_id] = request.sampling_params.max_tokens
        scheduler.add_request(request)
    tokens, results = {}, {}
    while scheduler.has_work():
        step(scheduler, runner, tokens, results)
        in_batch = {row.lora_slot for row in runner.rows.values() if row.lora_slot >= 0}
        assert len({runner.lora_slots[slot] for slot in in_batch}) <= 2
    assert {request_id: len(r.token_ids) for request_id, r in results.items()} == expected


def test_a_resumed_request_gets_its_adapters_slot_again(make_request):
    # Two requests of one adapter, a pool that holds only one of them at length: the later
    # one is preempted and resumes into the same slot, without a reload.
    scheduler, runner = make_scheduler(max_loras=2, num_blocks=6), FakeRunner(16)
    scheduler.add_request(make_request(40, lora=A, max_tokens=40, request_id="first"))
    scheduler.add_request(make_request(40, lora=A, max_tokens=40, request_id="second"))
    resumed, all_loads, tokens, results = [], [], {}, {}
    while scheduler.has_work():
        out, _ = step(scheduler, runner, tokens, results)
        all_loads += loads(out)
        resumed += [new for new in out.new_requests if new.output_token_ids]
    assert scheduler.num_preemptions > 0 and resumed
    assert all(new.lora_slot == 0 for new in resumed)
    assert all_loads == [(0, "a")]
    assert [len(results[r].token_ids) for r in ("first", "second")] == [40, 40]


def test_a_request_starved_of_a_slot_stops_others_joining_slots(make_request):
    # With a steady stream of a's requests, a's slot would never fall idle; after
    # starvation_steps the stream waits until b got the slot.
    scheduler, runner = make_scheduler(max_loras=1, starvation_steps=3), FakeRunner(16)
    scheduler.add_request(make_request(20, lora=A, max_tokens=4))
    scheduler.add_request(make_request(20, lora=B, max_tokens=2, request_id="b"))
    tokens, results = {}, {}
    for _ in range(30):
        scheduler.add_request(make_request(20, lora=A, max_tokens=4))
        step(scheduler, runner, tokens, results)
        if "b" in results:
            break
    assert "b" in results
    run_to_completion(scheduler, runner)


def test_a_request_with_an_adapter_is_refused_when_lora_is_off(make_request):
    scheduler = make_scheduler(max_loras=0)
    scheduler.add_request(make_request(20, lora=A, request_id="r"))
    [finished] = scheduler.take_finished()
    assert finished.finish_reason == "error" and "LoRA adapter 'a'" in finished.message


def test_two_adapters_share_no_prefix_blocks_and_one_adapter_shares_its_own(make_request):
    scheduler, runner = make_scheduler(), FakeRunner(16)
    prompt = list(range(3, 53))  # three full blocks
    scheduler.add_request(make_request(prompt=prompt, max_tokens=3, lora=A))
    run_to_completion(scheduler, runner)
    for adapter, expected_hit in [(B, 0), (None, 0), (A, 48)]:
        scheduler.add_request(make_request(prompt=prompt, max_tokens=3, lora=adapter))
        assert scheduler.schedule().new_requests[0].num_computed_tokens == expected_hit, adapter
        run_to_completion(scheduler, runner)


def test_stats_count_running_and_waiting_requests_by_adapter(make_request):
    scheduler, runner = make_scheduler(max_loras=1), FakeRunner(16)
    for adapter in (A, A, B, None):
        scheduler.add_request(make_request(20, lora=adapter, max_tokens=3))
    _, outputs = step(scheduler, runner, {}, {})
    assert outputs.stats.lora_running == {"a": 2} and outputs.stats.lora_waiting == {"b": 1}
    run_to_completion(scheduler, runner)
    assert scheduler.stats().lora_running == {} and scheduler.stats().lora_waiting == {}


def test_stats_leave_adapters_out_when_lora_is_off(make_request):
    scheduler, runner = make_scheduler(max_loras=0), FakeRunner(16)
    scheduler.add_request(make_request(20, max_tokens=3))
    _, outputs = step(scheduler, runner, {}, {})
    assert outputs.stats.lora_running == {} and outputs.stats.lora_waiting == {}


def test_an_adapter_the_workers_cannot_load_fails_its_requests_and_later_ones(make_request):
    scheduler, runner = make_scheduler(max_loras=1), FakeRunner(16)
    runner.unloadable_loras.add(A.lora_id)
    for request_id, adapter in [("a-running", A), ("base", None), ("b", B), ("a-waiting", A)]:
        scheduler.add_request(make_request(20, lora=adapter, max_tokens=3, request_id=request_id))
    results = run_to_completion(scheduler, runner)
    for request_id in ("a-running", "a-waiting"):
        assert results[request_id].finish_reason == "error" and results[request_id].token_ids == []
        assert "LoRA adapter 'a' could not be loaded" in results[request_id].message
    assert results["base"].finish_reason == results["b"].finish_reason == "length"
    scheduler.add_request(make_request(20, lora=A, request_id="a-later"))
    [refused] = scheduler.take_finished()
    assert refused.finish_reason == "error" and "could not be loaded" in refused.message
    assert scheduler.lora_slots.adapters == [B]
