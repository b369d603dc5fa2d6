"""Pipeline parallelism's batch queue, with a model-free two-stage executor: the EngineCore keeps
two micro-batches in flight, never one request in both, and the first stage (which samples
nothing) has every token the last stage sampled before a step needs it."""

from dataclasses import dataclass

from strata.engine_core.core import EngineCore
from strata.engine_core.speculative import SpeculativeConfig
from strata.engine_core.protocol import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput, unpack_handles
from strata.engine_core.sampling_params import SamplingParams
from strata.engine_core.scheduler import SchedulerConfig
from fake_runner import FakeExecutor

PATTERN = [7, 8, 9, 10]


@dataclass
class FirstStageRow:
    request_id: str
    token_ids: list[int]
    added_at: int  # the step that put the request in this row


class TwoStageExecutor(FakeExecutor):
    """The last stage is a ``FakeRunner``, run when a step is collected; the first stage keeps
    each row's tokens from the diffs plus the tokens the last stage sent it, taken in before a
    step as the real first stage does (``SampledTokenFeed``). Checks, as steps come and go, that
    no request is in two steps in flight and that the first stage ran every step with the last
    stage's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.last_stage = self.runner
        self.first_stage: dict[int, FirstStageRow] = {}  # by handle
        self.sent: dict[int, dict[int, list[int]]] = {}  # step -> handle -> tokens the last stage sent
        self.in_flight: dict[int, tuple[SchedulerOutput, set[str], dict[int, list[int]]]] = {}
        self.most_in_flight = 0
        self.batch_sizes: list[int] = []

    def submit(self, out: SchedulerOutput, grammar_bitmask=None) -> None:
        for step in sorted(s for s in self.sent if s <= out.collected_step):
            for handle, tokens in self.sent.pop(step).items():
                row = self.first_stage.get(handle)
                if row is not None and row.added_at <= step:
                    row.token_ids += tokens
        for handle in out.finished_handles + out.preempted_handles:
            del self.first_stage[handle]
        for new in out.new_requests:
            self.first_stage[new.handle] = FirstStageRow(new.request_id, new.prompt_token_ids + new.output_token_ids, out.step)
        handles = [new.handle for new in out.new_requests] + list(unpack_handles(out.cached.handles))
        request_ids = {self.first_stage[handle].request_id for handle in handles}
        for step, (_, others, _) in self.in_flight.items():
            assert not request_ids & others, f"{request_ids & others} in steps {step} and {out.step} at once"
        seen = {handle: list(self.first_stage[handle].token_ids) for handle in handles}
        self.in_flight[out.step] = (out, request_ids, seen)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self.batch_sizes.append(len(request_ids))

    def collect(self, step: int) -> ModelRunnerOutput:
        assert step == min(self.in_flight), "steps are collected in the order they were submitted"
        out, _, seen = self.in_flight.pop(step)
        for handle in unpack_handles(out.cached.handles):
            assert seen[handle] == self.last_stage.rows[handle].token_ids, f"the first stage ran {handle} on stale tokens"
        lengths = {handle: len(self.last_stage.rows[handle].token_ids) for handle in unpack_handles(out.cached.handles)}
        output = self.last_stage.execute(out)
        lengths.update({new.handle: len(new.prompt_token_ids) + len(new.output_token_ids) for new in out.new_requests})
        self.sent[step] = {handle: self.last_stage.rows[handle].token_ids[length:] for handle, length in lengths.items()}
        return output


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
