"""A model-free worker for scheduler tests: it keeps a persistent batch from the per-step
diffs exactly as a real worker must, checks what it is told, and "samples" a token that is
a deterministic function of the request's whole token history."""

from dataclasses import dataclass, field

from array import array

from strata.engine_core.protocol import (
    ModelRunnerOutput, PromptLogprobs, SchedulerOutput, pack_tokens, unpack_handles, unpack_tokens,
)
from strata.engine_core.scheduler import Scheduler


@dataclass
class Row:
    request_id: str
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    num_prompt: int = 0
    wants_prompt_logprobs: bool = False
    lora_slot: int = -1


def next_token(token_ids: list[int]) -> int:
    """Deterministic in the history, never below 3 (ids 0-2 are left for EOS in tests)."""
    return (sum(token_ids[-4:]) * 31 + 7 * len(token_ids)) % 997 + 3


def fake_prompt_logprob(position: int) -> float:
    """What the fake runner reports as the logprob of the prompt token at ``position``."""
    return -float(position)


@dataclass
class FakeRunner:
    block_size: int
    rows: dict[int, Row] = field(default_factory=dict)
    forced_tokens: dict[str, list[int]] = field(default_factory=dict)  # scripted outputs
    lora_slots: dict[int, int] = field(default_factory=dict)  # LoRA slot -> lora_id it holds
    unloadable_loras: set[int] = field(default_factory=set)  # lora_ids whose loads fail (files gone)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for handle in out.finished_handles + out.preempted_handles:
            del self.rows[handle]
        lora_load_errors = {}
        for load in out.lora_loads:
            assert all(row.lora_slot != load.slot for row in self.rows.values()), "reloaded a slot in use"
            self.lora_slots[load.slot] = load.adapter.lora_id
            if load.adapter.lora_id in self.unloadable_loras:
                lora_load_errors[load.adapter.lora_id] = f"LoRA adapter {load.adapter.name!r} could not be loaded"
        batch: list[tuple[Row, int]] = []
        for new in out.new_requests:
            assert new.handle not in self.rows, "handle reused before it was released"
            row = Row(new.request_id, new.prompt_token_ids + new.output_token_ids,
                       new.num_computed_tokens, list(new.block_ids), len(new.prompt_token_ids),
                       new.sampling_params.prompt_logprobs is not None, new.lora_slot)
            assert new.lora_slot < 0 or new.lora_slot in self.lora_slots, "a slot never loaded"
            self.rows[new.handle] = row
            batch.append((row, new.num_scheduled_tokens))
        drafts: dict[int, list[int]] = {}  # batch index -> drafts to verify
        for handle in unpack_handles(out.cached.handles):
            row = self.rows[handle]
            if handle in out.cached.kept_blocks:
                del row.block_ids[out.cached.kept_blocks[handle] :]
            row.block_ids += out.cached.new_block_ids.get(handle, [])
            if handle in out.cached.draft_token_ids:
                drafts[len(batch)] = list(unpack_tokens(out.cached.draft_token_ids[handle]))
            batch.append((row, out.cached.num_tokens.get(handle, 1)))
        assert sum(n for _, n in batch) == out.total_num_scheduled_tokens
        sampled = []
        prompt_logprobs = {}
        verified = {}
        for index, (row, num_tokens) in enumerate(batch):
            if index in drafts:
                produced = self._verify(row, num_tokens, drafts[index])
                sampled.append(produced[0])
                verified[index] = pack_tokens(produced)
                continue
            if row.wants_prompt_logprobs:
                scored = range(row.num_computed + 1, min(row.num_computed + num_tokens, row.num_prompt - 1) + 1)
                if scored:
                    prompt_logprobs[index] = PromptLogprobs(
                        scored.start, 1, pack_tokens(row.token_ids[scored.start : scored.stop]),
                        array("f", map(fake_prompt_logprob, scored)).tobytes(),
                    )
            row.num_computed += num_tokens
            assert row.num_computed <= len(row.token_ids), "scheduled tokens that do not exist"
            assert len(row.block_ids) * self.block_size >= row.num_computed, "not enough blocks"
            token = self._sample(row)
            sampled.append(token)
            if row.num_computed == len(row.token_ids):
                row.token_ids.append(token)
        return ModelRunnerOutput(
            step=out.step, sampled_token_ids=pack_tokens(sampled), prompt_logprobs=prompt_logprobs,
            verified_token_ids=verified, lora_load_errors=lora_load_errors,
        )

    def _verify(self, row: Row, num_tokens: int, drafts: list[int]) -> list[int]:
        """What a real worker does with drafts: the model's token at each draft position,
        kept while it equals the draft, then the model's own token."""
        assert num_tokens == 1 + len(drafts), "a verified row is scheduled its last token and its drafts"
        assert row.num_computed == len(row.token_ids) - 1, "drafts only follow a decoding request's last token"
        assert len(row.block_ids) * self.block_size >= row.num_computed + num_tokens, "no slots for the drafts"
        produced = []
        for draft in [*drafts, None]:
            token = self._sample(row)
            produced.append(token)
            row.token_ids.append(token)
            if token != draft:
                break
        row.num_computed = len(row.token_ids) - 1
        return produced

    def _sample(self, row: Row) -> int:
        script = self.forced_tokens.get(row.request_id)
        num_output = len(row.token_ids) - row.num_prompt
        if script and num_output < len(script):
            return script[num_output]
        return next_token(row.token_ids)


class FakeExecutor:
    """The EngineCore's executor over a ``FakeRunner``: one step at a time, in this process."""

    num_blocks = 100
    num_cpu_blocks = 0
    vocab_size = 1000

    def __init__(self) -> None:
        self.runner = FakeRunner(16)

    def execute(self, out: SchedulerOutput, grammar_bitmask=None) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        pass


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str
    message: str | None
    prompt_logprobs: list[tuple[int, int, float]] = field(default_factory=list)  # (position, token, logprob)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 100_000) -> dict[str, Result]:
    """Step until nothing is left, checking invariants after every step."""
    results: dict[str, Result] = {}
    tokens: dict[str, list[int]] = {}
    prompt_logprobs: dict[str, list[tuple[int, int, float]]] = {}
    for _ in range(max_steps):
        step(scheduler, runner, tokens, results, prompt_logprobs)
        if not scheduler.has_work():
            return results
    raise AssertionError(f"not finished after {max_steps} steps")


def step(scheduler: Scheduler, runner: FakeRunner, tokens: dict[str, list[int]], results: dict[str, Result],
         prompt_logprobs: dict[str, list[tuple[int, int, float]]] | None = None):
    """One step; ``tokens`` and ``prompt_logprobs`` gather what unfinished requests received."""
    prompt_logprobs = {} if prompt_logprobs is None else prompt_logprobs
    out = scheduler.schedule()
    result = runner.execute(out)
    # The step's rows write into the blocks the scheduler gave them, no more and no others (rows
    # of requests the scheduler no longer holds are a test scheduling around the runner).
    for handle in [new.handle for new in out.new_requests] + list(unpack_handles(out.cached.handles)):
        row = runner.rows[handle]
        if row.request_id in scheduler.kv.req_to_blocks:
            assert row.block_ids == scheduler.kv.get_block_ids(row.request_id), f"{row.request_id}'s block table"
        request = scheduler.requests.get(row.request_id)
        if request is not None and request.lora is not None:
            assert runner.lora_slots[row.lora_slot] == request.lora.lora_id, f"{row.request_id}'s adapter"
    outputs = scheduler.update_from_output(out, result)
    scheduler.check_invariants()
    for request_id, received in outputs.prompt_logprobs.items():
        positions = range(received.first_position, received.first_position + received.num_positions)
        values = array("f")
        values.frombytes(received.logprobs)
        prompt_logprobs.setdefault(request_id, []).extend(zip(positions, unpack_tokens(received.token_ids), values))
    for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
        tokens.setdefault(request_id, []).append(token)
    for finished in outputs.finished:
        results[finished.request_id] = Result(
            tokens.pop(finished.request_id, []), finished.finish_reason, finished.message,
            prompt_logprobs.pop(finished.request_id, []),
        )
    return out, outputs
