"""A model-free worker for scheduler tests: it keeps a persistent batch from the per-step
diffs exactly as a real worker must, checks what it is told, and "samples" a token that is
a deterministic function of the request's whole token history."""

from dataclasses import dataclass, field

from strata.engine_core.protocol import ModelRunnerOutput, SchedulerOutput, pack_tokens, unpack_handles
from strata.engine_core.scheduler import Scheduler


@dataclass
class Row:
    request_id: str
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    num_prompt: int = 0


def next_token(token_ids: list[int]) -> int:
    """Deterministic in the history, never below 3 (ids 0-2 are left for EOS in tests)."""
    return (sum(token_ids[-4:]) * 31 + 7 * len(token_ids)) % 997 + 3


@dataclass
class FakeRunner:
    block_size: int
    rows: dict[int, Row] = field(default_factory=dict)
    forced_tokens: dict[str, list[int]] = field(default_factory=dict)  # scripted outputs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for handle in out.finished_handles + out.preempted_handles:
            del self.rows[handle]
        batch: list[tuple[Row, int]] = []
        for new in out.new_requests:
            assert new.handle not in self.rows, "handle reused before it was released"
            row = Row(new.request_id, new.prompt_token_ids + new.output_token_ids,
                       new.num_computed_tokens, list(new.block_ids), len(new.prompt_token_ids))
            self.rows[new.handle] = row
            batch.append((row, new.num_scheduled_tokens))
        for handle in unpack_handles(out.cached.handles):
            row = self.rows[handle]
            row.block_ids += out.cached.new_block_ids.get(handle, [])
            batch.append((row, out.cached.num_tokens.get(handle, 1)))
        assert sum(n for _, n in batch) == out.total_num_scheduled_tokens
        sampled = []
        for row, num_tokens in batch:
            row.num_computed += num_tokens
            assert row.num_computed <= len(row.token_ids), "scheduled tokens that do not exist"
            assert len(row.block_ids) * self.block_size >= row.num_computed, "not enough blocks"
            token = self._sample(row)
            sampled.append(token)
            if row.num_computed == len(row.token_ids):
                row.token_ids.append(token)
        return ModelRunnerOutput(step=out.step, sampled_token_ids=pack_tokens(sampled))

    def _sample(self, row: Row) -> int:
        script = self.forced_tokens.get(row.request_id)
        num_output = len(row.token_ids) - row.num_prompt
        if script and num_output < len(script):
            return script[num_output]
        return next_token(row.token_ids)


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str
    message: str | None


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 100_000) -> dict[str, Result]:
    """Step until nothing is left, checking invariants after every step."""
    results: dict[str, Result] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        step(scheduler, runner, tokens, results)
        if not scheduler.has_work():
            return results
    raise AssertionError(f"not finished after {max_steps} steps")


def step(scheduler: Scheduler, runner: FakeRunner, tokens: dict[str, list[int]], results: dict[str, Result]):
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner.execute(out))
    scheduler.check_invariants()
    for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
        tokens.setdefault(request_id, []).append(token)
    for finished in outputs.finished:
        results[finished.request_id] = Result(
            tokens.pop(finished.request_id, []), finished.finish_reason, finished.message
        )
    return out, outputs
