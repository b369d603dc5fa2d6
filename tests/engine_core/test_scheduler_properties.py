"""Random workloads: whatever arrives, with whatever budgets and pool, every step keeps the
KV invariants and the budgets, and every request ends with a reason (no deadlock, no loss)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.engine_core.protocol import unpack_handles
from strata.engine_core.request import Request
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import Scheduler, SchedulerConfig
from fake_runner import FakeRunner, Result, step

arrival = st.tuples(
    st.integers(0, 30),  # step at which it arrives
    st.integers(1, 120),  # prompt length
    st.integers(1, 40),  # max tokens
    st.integers(0, 3),  # priority
    st.sampled_from([None, 0, 3]),  # step after arrival at which it is aborted
    st.integers(0, 3),  # which of a few shared prefixes it starts with
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=25),
    block_size=st.sampled_from([2, 4, 16]),
    num_blocks=st.integers(8, 120),
    budget=st.integers(1, 256),
    max_num_seqs=st.integers(1, 12),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
)
def test_random_workload_keeps_invariants_and_finishes_everything(
    arrivals, block_size, num_blocks, budget, max_num_seqs, policy, caching
):
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=200,
        block_size=block_size, policy=policy, enable_prefix_caching=caching, starvation_steps=20,
    )
    scheduler = Scheduler(config, num_blocks)
    runner = FakeRunner(block_size)
    results: dict[str, Result] = {}
    tokens: dict[str, list[int]] = {}
    aborts: dict[int, list[str]] = {}
    expected = set()
    for step_index in range(10_000):
        for i, (at, length, max_tokens, priority, abort_after, prefix) in enumerate(arrivals):
            if at == step_index:
                request_id = f"r{i}"
                prompt = [prefix + 3] * min(length, 40) + [(i * 17 + j) % 900 + 3 for j in range(max(0, length - 40))]
                scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                              None, float(at), priority))
                expected.add(request_id)
                if abort_after is not None:
                    aborts.setdefault(step_index + abort_after, []).append(request_id)
        scheduler.abort_requests(aborts.pop(step_index, []))
        if scheduler.has_work():
            out, _ = step(scheduler, runner, tokens, results)
            assert out.total_num_scheduled_tokens <= budget
            assert len(out.new_requests) + len(unpack_handles(out.cached.handles)) <= max_num_seqs
        elif step_index > max(a[0] for a in arrivals):
            break
    assert set(results) == expected, "a request was lost or never finished"
    for request_id, result in results.items():
        assert result.finish_reason in {"length", "abort", "error"}
        if result.finish_reason == "length":
            index = int(request_id[1:])
            assert len(result.token_ids) == min(arrivals[index][2], 200 - arrivals[index][1])
    assert scheduler.kv.req_to_blocks == {} and scheduler.kv.num_free_blocks == num_blocks
