"""Asynchronous scheduling, with a model-free executor that takes steps ahead as the mp one
does: the EngineCore schedules a step while the one before is in flight, a decoding request in
both, and the tokens, stops, aborts and preemptions come out as one step at a time gives them."""

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from strata.engine_core.core import EngineCore
from strata.engine_core.protocol import (
    EngineCoreRequest, ModelRunnerOutput, SchedulerOutput, TokenLogprobs, unpack_handles, unpack_tokens,
)
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import SchedulerConfig
from strata.engine_core.speculative import SpeculativeConfig
from fake_runner import FakeExecutor, FakeRunner, Row

EOS = 1


class AheadExecutor(FakeExecutor):
    """``submit`` queues a step; ``collect`` runs the queued steps in order on the FakeRunner,
    which keeps its own tokens as a worker does: a step finds the token the one before it
    sampled. Records how many steps were in flight and whether a request was in two."""

    def __init__(self, num_blocks: int = 100) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        self.queued: list[SchedulerOutput] = []
        self.outputs: dict[int, ModelRunnerOutput] = {}
        self.most_in_flight = 0
        self.shared_a_request = False
        self.scheduled_tokens = 0
        self.empty_steps = 0

    def submit(self, out: SchedulerOutput, grammar_bitmask=None) -> None:
        handles = set(unpack_handles(out.cached.handles))
        self.shared_a_request |= any(handles & set(unpack_handles(queued.cached.handles)) for queued in self.queued)
        self.queued.append(out)
        self.most_in_flight = max(self.most_in_flight, len(self.queued) + len(self.outputs))
        self.scheduled_tokens += out.total_num_scheduled_tokens
        self.empty_steps += out.total_num_scheduled_tokens == 0

    def collect(self, step: int) -> ModelRunnerOutput:
        while step not in self.outputs:
            out = self.queued.pop(0)
            self.outputs[out.step] = self.runner.execute(out)
        return self.outputs.pop(step)


class CountingExecutor(FakeExecutor):
    """One step at a time, counting the tokens scheduled."""

    def __init__(self, num_blocks: int = 100) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        self.scheduled_tokens = 0

    def execute(self, out: SchedulerOutput, grammar_bitmask=None) -> ModelRunnerOutput:
        self.scheduled_tokens += out.total_num_scheduled_tokens
        return super().execute(out)


def requests(count: int, max_tokens: Callable[[int], int] = lambda i: 4 + i % 5) -> list[EngineCoreRequest]:
    """Prompts from 5 to 5 + 11 * (count - 1) tokens: long ones are chunked at a budget of 64."""
    return [
        EngineCoreRequest(
            f"r{i}", [3 + (i * 37 + j) % 900 for j in range(5 + 11 * i)],
            SamplingParams(max_tokens=max_tokens(i), ignore_eos=True), EOS, 0.0,
        )
        for i in range(count)
    ]


def engine(executor: FakeExecutor, **config) -> EngineCore:
    return EngineCore(SchedulerConfig(max_num_batched_tokens=64, **config), executor)


def run(core: EngineCore, batch: list[EngineCoreRequest], between_steps: Callable[[int], None] = lambda step: None
        ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every request's tokens and finish reason; ``between_steps(n)`` runs after the n-th step."""
    for request in batch:
        core.add_request(request)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = 0
    while core.has_work():
        outputs = core.step()
        core.scheduler.check_invariants()
        for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
            assert request_id not in reasons, f"{request_id} got a token after it finished"
            tokens.setdefault(request_id, []).append(token)
        reasons.update((finished.request_id, finished.finish_reason) for finished in outputs.finished)
        steps += 1
        between_steps(steps)
    return tokens, reasons


def test_steps_scheduled_ahead_give_the_tokens_of_one_step_at_a_time():
    ahead = AheadExecutor()
    assert run(engine(ahead, async_scheduling=True), requests(12)) == run(engine(FakeExecutor()), requests(12))
    assert ahead.most_in_flight == 2 and ahead.shared_a_request


def test_a_request_that_its_token_in_flight_ends_by_length_is_not_scheduled_again():
    ahead, one_at_a_time = AheadExecutor(), CountingExecutor()
    run(engine(ahead, async_scheduling=True), requests(12))
    run(engine(one_at_a_time), requests(12))
    assert ahead.scheduled_tokens == one_at_a_time.scheduled_tokens and ahead.empty_steps == 0


def test_a_stop_token_sampled_while_the_next_step_is_in_flight_ends_the_request_there():
    def batch() -> list[EngineCoreRequest]:
        stopping = [EngineCoreRequest(f"s{i}", [5, 6, 7 + i], SamplingParams(max_tokens=20), EOS, 0.0) for i in range(3)]
        return stopping + requests(4, max_tokens=lambda i: 12)

    ahead, one_at_a_time = AheadExecutor(), CountingExecutor()
    for executor in (ahead, one_at_a_time):
        for i in range(3):  # the third token is EOS
            executor.runner.forced_tokens[f"s{i}"] = [40 + i, 50 + i, EOS]
    tokens, reasons = run(engine(ahead, async_scheduling=True), batch())
    assert (tokens, reasons) == run(engine(one_at_a_time), batch())
    assert tokens["s0"] == [40, 50, EOS] and reasons["s0"] == "stop"
    # Each stopped request computed one row for nothing: its step scheduled before the stop came back.
    assert ahead.scheduled_tokens == one_at_a_time.scheduled_tokens + 3


def test_an_abort_while_its_steps_are_in_flight_leaves_the_other_requests_untouched():
    ahead = AheadExecutor()
    core = engine(ahead, async_scheduling=True)

    def abort_r3(step: int) -> None:
        if step == 3:
            assert ahead.queued, "a step is in flight"
            core.abort_requests(["r3"])

    tokens, reasons = run(core, requests(6, max_tokens=lambda i: 10), between_steps=abort_r3)
    untouched, _ = run(engine(FakeExecutor()), requests(6, max_tokens=lambda i: 10))
    assert reasons["r3"] == "abort" and len(tokens.get("r3", [])) < 10
    assert {r: t for r, t in tokens.items() if r != "r3"} == {r: t for r, t in untouched.items() if r != "r3"}


def test_requests_preempted_with_a_step_in_flight_give_the_tokens_of_one_step_at_a_time():
    # 12 blocks of 16 tokens for requests growing to 60 tokens and more: they preempt each other.
    ahead = AheadExecutor(num_blocks=12)
    core = engine(ahead, async_scheduling=True)
    assert run(core, requests(8, max_tokens=lambda i: 40)) == run(
        engine(FakeExecutor()), requests(8, max_tokens=lambda i: 40)
    )
    assert core.scheduler.num_preemptions > 0


@dataclass
class RecomputeDiffersRunner(FakeRunner):
    """A resumed request samples other tokens than it did before its preemption, as a model's
    recompute may where logits nearly tie: a token kept from a step that ran before the
    preemption would then disagree with the worker's. Every row reports its token's logprob."""

    resumed: set[str] = field(default_factory=set)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.resumed.update(new.request_id for new in out.new_requests if new.output_token_ids)
        output = super().execute(out)
        output.logprobs = {row: [TokenLogprobs([token], [-1.0])] for row, token in enumerate(unpack_tokens(output.sampled_token_ids))}
        return output

    def _sample(self, row: Row) -> int:
        token = super()._sample(row)
        return (token + 500) % 997 + 3 if row.request_id in self.resumed else token


def assert_workers_hold_the_known_tokens(core: EngineCore, runner: FakeRunner) -> None:
    for request in core.scheduler.running:
        row = runner.rows.get(request.handle)
        if row is not None and row.request_id == request.request_id:  # not a row a queued step adds
            known = request.all_token_ids
            assert row.token_ids[: len(known)] == known, f"{request.request_id}: the worker's tokens differ"


arrival = st.tuples(
    st.integers(0, 20),  # step at which it arrives
    st.integers(1, 90),  # prompt length
    st.integers(1, 30),  # max tokens
    st.integers(0, 3),  # priority
    st.sampled_from([None, 0, 2]),  # steps after arrival at which it is aborted
    st.sampled_from([None, 4, 9]),  # the output position whose token is EOS
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=16),
    num_blocks=st.integers(6, 60),
    budget=st.integers(8, 128),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
)
@example(  # r3 is preempted while its step is in flight and admitted again in the same step
    arrivals=[(0, 1, 1, 0, None, None), (0, 1, 1, 0, None, None), (0, 1, 23, 0, None, None),
              (0, 1, 25, 0, None, None), (19, 1, 1, 0, None, None)],
    num_blocks=6, budget=8, max_num_seqs=2, policy="fcfs",
)
def test_random_workloads_scheduled_ahead_keep_the_workers_tokens_and_finish_everything(
    arrivals, num_blocks, budget, max_num_seqs, policy
):
    ahead = AheadExecutor(num_blocks)
    ahead.runner = RecomputeDiffersRunner(16)
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=160, policy=policy,
        starvation_steps=5, async_scheduling=True,
    )
    core = EngineCore(config, ahead)
    aborts: dict[int, list[str]] = {}
    finished: set[str] = set()
    for step in range(5_000):
        for i, (at, length, max_tokens, priority, abort_after, eos_at) in enumerate(arrivals):
            if at == step:
                prompt = [3 + (i * 17 + j) % 40 for j in range(length)]  # few distinct tokens: shared prefixes
                if eos_at is not None:
                    ahead.runner.forced_tokens[f"r{i}"] = [50] * eos_at + [EOS]
                params = SamplingParams(max_tokens=max_tokens)
                core.add_request(EngineCoreRequest(f"r{i}", prompt, params, EOS, float(at), priority))
                if abort_after is not None:
                    aborts.setdefault(step + abort_after, []).append(f"r{i}")
        core.abort_requests(aborts.pop(step, []))
        if step > max(a[0] for a in arrivals) and not core.has_work():
            break
        if core.has_work():
            outputs = core.step()
            core.scheduler.check_invariants()
            assert_workers_hold_the_known_tokens(core, ahead.runner)
            given: dict[str, list[int]] = {}
            for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
                given.setdefault(request_id, []).append(token)
            logprobs = {request_id: [entry.token_ids[0] for entry in entries] for request_id, entries in outputs.logprobs.items()}
            assert logprobs == given, "logprobs only, and all, for the tokens given"
            finished.update(f.request_id for f in outputs.finished)
    assert finished == {f"r{i}" for i in range(len(arrivals))}


def test_async_scheduling_with_pipeline_stages_or_drafts_is_refused():
    for config in ({"pipeline_depth": 2}, {"speculative": SpeculativeConfig("ngram", num_speculative_tokens=2)}):
        with pytest.raises(ValueError, match="async_scheduling needs one pipeline stage and no speculative decoding"):
            SchedulerConfig(async_scheduling=True, **config)
