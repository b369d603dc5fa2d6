"""Priority preemption: under ``--scheduling-policy priority`` a waiting request that outranks
the lowest running one and does not fit takes its place; the starvation guard keeps a
low-priority request from being pushed out forever, and nothing ping-pongs."""

from strata.engine_core.request import RequestStatus
from strata.engine_core.scheduler import Scheduler, SchedulerConfig
from fake_runner import FakeRunner, run_to_completion, step


def make_scheduler(num_blocks: int, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    config.setdefault("policy", "priority")
    return Scheduler(SchedulerConfig(max_model_len=1024, **config), num_blocks)


def fill_with_two_running(scheduler: Scheduler, runner: FakeRunner, make_request):
    """Two 10-token prompts (three blocks each) running in a pool of seven blocks."""
    low = make_request(10, request_id="low", priority=5, arrival_time=1.0, max_tokens=2)
    mid = make_request(10, request_id="mid", priority=3, arrival_time=2.0, max_tokens=2)
    scheduler.add_request(low)
    scheduler.add_request(mid)
    step(scheduler, runner, {}, {})
    assert low.status == mid.status == RequestStatus.RUNNING and scheduler.kv.num_free_blocks == 1
    return low, mid


def test_high_priority_arrival_preempts_the_lowest_running_request(make_request):
    scheduler, runner = make_scheduler(num_blocks=7), FakeRunner(4)
    low, mid = fill_with_two_running(scheduler, runner, make_request)
    low_handle = low.handle
    scheduler.add_request(make_request(10, request_id="high", priority=0, arrival_time=3.0, max_tokens=2))
    out, _ = step(scheduler, runner, {}, {})
    assert out.preempted_handles == [low_handle]
    assert [new.request_id for new in out.new_requests] == ["high"]
    assert low.status == RequestStatus.PREEMPTED and mid.num_preemptions == 0
    results = run_to_completion(scheduler, runner)
    assert results["low"].finish_reason == results["high"].finish_reason == "length"


def test_arrival_of_equal_priority_waits_instead_of_preempting(make_request):
    scheduler, runner = make_scheduler(num_blocks=7), FakeRunner(4)
    fill_with_two_running(scheduler, runner, make_request)
    scheduler.add_request(make_request(10, request_id="peer", priority=5, arrival_time=3.0, max_tokens=2))
    out, _ = step(scheduler, runner, {}, {})
    assert out.preempted_handles == [] and out.new_requests == []


def test_fcfs_policy_never_preempts_for_an_arrival(make_request):
    scheduler, runner = make_scheduler(num_blocks=7, policy="fcfs"), FakeRunner(4)
    fill_with_two_running(scheduler, runner, make_request)
    scheduler.add_request(make_request(10, request_id="high", priority=0, arrival_time=3.0, max_tokens=2))
    out, _ = step(scheduler, runner, {}, {})
    assert out.preempted_handles == [] and out.new_requests == []


def run_low_priority_under_a_stream_of_high_priority(make_request, starvation_steps: int | None):
    """One long low-priority request; a high-priority one arrives every third step for 300
    steps, each needing most of the pool. Returns the step the low one finished at (None if
    it had not by the end of the stream), the results, and the low request."""
    scheduler, runner = make_scheduler(num_blocks=12, starvation_steps=starvation_steps), FakeRunner(4)
    low = make_request(20, request_id="low", priority=9, max_tokens=24, ignore_eos=True)
    scheduler.add_request(low)
    tokens, results, low_done_at = {}, {}, None
    for step_number in range(300):
        if step_number % 3 == 0:
            scheduler.add_request(
                make_request(20, request_id=f"high-{step_number}", priority=0, arrival_time=float(step_number),
                             max_tokens=4, ignore_eos=True)
            )
        step(scheduler, runner, tokens, results)
        if low_done_at is None and "low" in results:
            low_done_at = step_number
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        step(scheduler, runner, tokens, results)
    assert not scheduler.has_work(), "requests left after the stream ended: a livelock"
    return low_done_at, results, low


def test_steady_high_priority_stream_cannot_starve_a_low_priority_request(make_request):
    starved_at, _, _ = run_low_priority_under_a_stream_of_high_priority(make_request, starvation_steps=None)
    assert starved_at is None, "the scenario must starve the low request without the guard"
    done_at, results, low = run_low_priority_under_a_stream_of_high_priority(make_request, starvation_steps=20)
    assert done_at is not None and done_at < 150
    assert results["low"].finish_reason == "length" and len(results["low"].token_ids) == 24
    assert all(r.finish_reason == "length" and len(r.token_ids) == 4 for k, r in results.items() if k != "low")
    assert low.num_preemptions < 20, "the boosted low request is not pushed out again and again"


def test_a_request_preempted_holding_the_whole_pool_ends_with_error_instead_of_waiting_forever(make_request):
    scheduler, runner = make_scheduler(num_blocks=7), FakeRunner(4)
    low = make_request(10, request_id="low", priority=5, max_tokens=100, ignore_eos=True)
    scheduler.add_request(low)
    while low.num_computed_tokens < 28:
        step(scheduler, runner, {}, {})
    assert len(low.all_token_ids) == 29, "its next token needs an eighth block of a seven-block pool"
    scheduler.add_request(make_request(4, request_id="high", priority=0, max_tokens=2))
    results = run_to_completion(scheduler, runner)
    assert low.num_preemptions == 1
    assert results["low"].finish_reason == "error" and "even alone" in results["low"].message
    assert results["high"].finish_reason == "length"
