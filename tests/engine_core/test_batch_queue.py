"""Pipeline parallelism's batch queue, with a model-free two-stage executor: the EngineCore keeps
two micro-batches in flight, never one request in both, and the first stage (which samples
nothing) learns every token the last stage sampled from the step messages alone."""

from strata.engine_core.core import EngineCore
from strata.engine_core.ngram_proposer import SpeculativeConfig
from strata.engine_core.protocol import (
    EngineCoreRequest, ModelRunnerOutput, SchedulerOutput, unpack_handles, unpack_tokens,
)
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import SchedulerConfig
from fake_runner import FakeExecutor

PATTERN = [7, 8, 9, 10]


class TwoStageExecutor(FakeExecutor):
    """The last stage is a ``FakeRunner``, run when a step is collected; the first stage keeps
    each row's tokens from the diffs as a real first stage does. Checks, as steps come and go,
    that no request is in two steps in flight and that both stages agree on every row's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.last_stage = self.runner
        self.first_stage: dict[int, tuple[str, list[int]]] = {}  # handle -> (request id, tokens)
        self.in_flight: dict[int, tuple[SchedulerOutput, set[str]]] = {}
        self.most_in_flight = 0
        self.batch_sizes: list[int] = []

    def submit(self, out: SchedulerOutput, grammar_bitmask=None) -> None:
        request_ids = self._first_stage_step(out)
        for step, (_, others) in self.in_flight.items():
            assert not request_ids & others, f"{request_ids & others} in steps {step} and {out.step} at once"
        self.in_flight[out.step] = (out, request_ids)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self.batch_sizes.append(len(request_ids))

    def collect(self, step: int) -> ModelRunnerOutput:
        assert step == min(self.in_flight), "steps are collected in the order they were submitted"
        out, _ = self.in_flight.pop(step)
        for handle in unpack_handles(out.cached.handles):
            assert self.first_stage[handle][1] == self.last_stage.rows[handle].token_ids, f"stages disagree on {handle}"
        return self.last_stage.execute(out)

    def _first_stage_step(self, out: SchedulerOutput) -> set[str]:
        for handle in out.finished_handles + out.preempted_handles:
            del self.first_stage[handle]
        for new in out.new_requests:
            self.first_stage[new.handle] = (new.request_id, new.prompt_token_ids + new.output_token_ids)
        sampled = iter(unpack_tokens(out.cached.sampled_token_ids))
        cached = unpack_handles(out.cached.handles)
        for handle in cached:
            tokens = self.first_stage[handle][1]
            tokens.extend(next(sampled) for _ in range(out.cached.num_sampled.get(handle, 1)))
        return {self.first_stage[handle][0] for handle in [new.handle for new in out.new_requests] + list(cached)}


def requests(count: int) -> list[EngineCoreRequest]:
    return [
        EngineCoreRequest(
            f"r{i}", [3 + (i * 37 + j) % 900 for j in range(5 + 11 * i)],
            SamplingParams(max_tokens=4 + i % 5, ignore_eos=True), None, 0.0,
        )
        for i in range(count)
    ]


def run(core: EngineCore, batch: list[EngineCoreRequest]) -> dict[str, list[int]]:
    for request in batch:
        core.add_request(request)
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        outputs = core.step()
        for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
            tokens.setdefault(request_id, []).append(token)
    core.scheduler.check_invariants()
    return tokens


def test_two_micro_batches_in_flight_never_share_a_request_and_give_the_one_stage_tokens():
    pipelined = TwoStageExecutor()
    tokens = run(EngineCore(SchedulerConfig(max_num_batched_tokens=64, pipeline_depth=2), pipelined), requests(12))
    assert pipelined.most_in_flight == 2
    assert tokens == run(EngineCore(SchedulerConfig(max_num_batched_tokens=64), FakeExecutor()), requests(12))


def test_decoding_requests_are_shared_evenly_between_the_micro_batches():
    pipelined = TwoStageExecutor()
    batch = [EngineCoreRequest(f"r{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=6, ignore_eos=True), None, 0.0)
             for i in range(8)]
    run(EngineCore(SchedulerConfig(pipeline_depth=2), pipelined), batch)
    assert pipelined.batch_sizes[0] == 8  # all admitted at once; then decodes alternate halves
    assert set(pipelined.batch_sizes[2:-1]) == {4}


def test_the_first_stage_learns_every_verified_draft_token():
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=3)
    pipelined = TwoStageExecutor()
    batch = [
        EngineCoreRequest(f"r{i}", PATTERN * 4, SamplingParams(max_tokens=30, ignore_eos=True), None, 0.0)
        for i in range(6)
    ]
    for request in batch:  # the model keeps writing the prompt's pattern: drafts are accepted
        pipelined.last_stage.forced_tokens[request.request_id] = PATTERN * 8
    core = EngineCore(SchedulerConfig(pipeline_depth=2, speculative=ngram), pipelined)
    tokens = run(core, batch)
    assert core.scheduler.spec.accepted_tokens > 0 and pipelined.most_in_flight == 2
    assert tokens == {request.request_id: (PATTERN * 8)[:30] for request in batch}
