"""The EngineCore: scheduler + executor, one step at a time.

This module is the loop body; ``runtime/core_process.py`` runs it in its own process behind
ZeroMQ sockets. An executor is anything that runs a ``SchedulerOutput`` on the workers. With
pipeline parallelism a step keeps up to ``pipeline_depth`` micro-batches in flight (a batch
queue): it schedules and submits until the queue is full or nothing is left to schedule, then
completes the oldest. Asynchronous scheduling is the same queue two deep, with a request in
both steps: the workers find the next step waiting when they finish one, instead of idling
while this process takes in the output and schedules. While a request decodes under a grammar,
whose mask needs the token before, the queue is one deep.
"""

import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

from strata.engine_core.held_outputs import HeldOutputs
from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.kv_events import KVEventPublisher
from strata.engine_core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishedRequest,
    ModelRunnerOutput,
    SchedulerOutput,
    pack_handles,
    unpack_tokens,
)
from strata.engine_core.request import Request
from strata.engine_core.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from strata.engine_core.structured_output import StructuredOutputs

# With nothing to run but grammars compiling, a step waits this long for one of them.
GRAMMAR_WAIT_S = 0.05


class Executor(Protocol):
    """Runs steps on the workers. ``num_blocks`` is the KV-cache size the workers allocated,
    ``num_cpu_blocks`` their CPU offload tier's (0 = none); ``vocab_size`` bounds token ids."""

    num_blocks: int
    num_cpu_blocks: int
    vocab_size: int

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], bytes] | None = None
    ) -> ModelRunnerOutput:
        """Run a step. When ``scheduler_output.structured_rows`` is set, ``grammar_bitmask``
        computes those rows' masks: call it after the step is on its way to the workers."""
        ...

    def stats(self) -> dict[str, float]:
        """Executor-specific timings (e.g. IPC cost per step) for debug calls and benchmarks."""
        ...

    def shutdown(self) -> None: ...


class PipelinedExecutor(Executor, Protocol):
    """An executor that takes a step before the earlier ones are done (pipeline stages)."""

    def submit(self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], bytes] | None = None) -> None:
        """Send a step on its way; ``grammar_bitmask`` as for ``execute``."""
        ...

    def collect(self, step: int) -> ModelRunnerOutput:
        """The output of ``step``, submitted earlier (steps are collected in submission order)."""
        ...


class EngineCore:
    """Steps the scheduler on the executor. With an ``event_publisher``, every step's KV
    events go out as one batch; without, the connector's are still drained and dropped.
    ``tokenizer_path``: the model's ``tokenizer.json``, which grammars are compiled against;
    without it, requests with ``structured_outputs`` are refused."""

    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        connector: SchedulerConnector | None = None,
        event_publisher: KVEventPublisher | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        self.executor = executor
        self.queue_depth = 2 if config.async_scheduling else config.pipeline_depth
        self.async_scheduling = config.async_scheduling
        self._batch_queue: deque[SchedulerOutput] = deque()  # submitted, not yet collected
        self.event_publisher = event_publisher
        self.scheduler = Scheduler(config, executor.num_blocks, connector, record_kv_events=event_publisher is not None)
        self.tokenizer_path = tokenizer_path
        self.structured: StructuredOutputs | None = None  # built with the first grammar
        self._awaiting_grammar: dict[str, Request] = {}  # WAITING_FOR_GRAMMAR, outside the scheduler
        self._finished: list[FinishedRequest] = []  # requests finished while awaiting their grammar
        self.held = HeldOutputs()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never run is answered with an ``error`` output."""
        if not request.stream:
            self.held.hold(request.request_id)
        error = self._token_id_error(request)
        if error is not None:
            self.scheduler.reject(request.request_id, error)
            return
        params = request.sampling_params
        if params.seed is None:
            # Every request gets a seed so all TP ranks draw the same random numbers.
            params = msgspec.structs.replace(params, seed=random.getrandbits(63))
        scheduled = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time or time.time(),
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora=request.lora,
        )
        if params.structured_outputs is None:
            self.scheduler.add_request(scheduled)
            return
        if self.tokenizer_path is None:
            self.scheduler.reject(request.request_id, "structured outputs need the model's tokenizer.json")
            return
        if request.request_id in self._awaiting_grammar or request.request_id in self.scheduler.requests:
            self.scheduler.reject(request.request_id, f"request id {request.request_id!r} is already in use")
            return
        if self.structured is None:
            from strata.engine_core.structured_output import GrammarCheckedProposer, StructuredOutputs

            self.structured = StructuredOutputs(self.tokenizer_path, self.executor.vocab_size, request.eos_token_id)
            if self.scheduler.proposer is not None:
                self.scheduler.proposer = GrammarCheckedProposer(self.scheduler.proposer, self.structured)
        self._awaiting_grammar[request.request_id] = scheduled
        self.structured.submit(request.request_id, params.structured_outputs)

    def _token_id_error(self, request: EngineCoreRequest) -> str | None:
        """Every token id that would reach a worker must index its vocabulary: an id outside
        it makes the worker's sampler index out of range and takes the whole engine down."""
        vocab_size = self.executor.vocab_size
        named_ids = (
            ("prompt token id", request.prompt_token_ids),
            ("stop_token_ids entry", request.sampling_params.stop_token_ids or ()),
            ("eos_token_id", () if request.eos_token_id is None else (request.eos_token_id,)),
            ("logit_bias token id", request.sampling_params.logit_bias or ()),
        )
        for name, token_ids in named_ids:
            bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                return f"{name} {bad} is outside the vocabulary [0, {vocab_size})"
        return None

    def abort_requests(self, request_ids: list[str], message: str | None = None) -> None:
        """Abort the named requests (finish them with ``error`` if a message is given)."""
        for request_id in request_ids:
            if self._awaiting_grammar.pop(request_id, None) is not None:
                self._finished.append(FinishedRequest(request_id, "error" if message else "abort", message))
            if self.structured is not None:
                self.structured.remove(request_id)
        self.scheduler.abort_requests(request_ids, message)

    def abort_everything(self, reason: str) -> EngineCoreOutputs:
        """Fail every request (the engine is stopping): the outputs that end them all, theirs
        marked ``engine_fault``, those already finished (a refusal not yet reported) as they were."""
        failing = [*self._awaiting_grammar, *self.scheduler.requests]
        self.abort_requests(failing, reason)
        finished, self._finished = self._finished + self.scheduler.take_finished(), []
        failed = set(failing)
        for output in finished:
            output.engine_fault = output.request_id in failed
        return self.held.filter(EngineCoreOutputs(finished=finished))

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work() or bool(self._awaiting_grammar) or bool(self._finished) or bool(self._batch_queue)
        )

    def step(self) -> EngineCoreOutputs:
        if self.structured is not None and self._awaiting_grammar:
            self._admit_compiled()
            if not self.scheduler.has_work():
                # Nothing runs: wait for a grammar here instead of sending the workers empty steps.
                self.structured.wait_for_compile(GRAMMAR_WAIT_S)
                self._admit_compiled()
        if not self.scheduler.has_work() and not self._batch_queue:
            finished, self._finished = self._finished, []
            return self.held.filter(EngineCoreOutputs(finished=finished))
        scheduler_output, runner_output = self._run_step()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.structured is not None and self.structured.matchers:
            self._advance_matchers(outputs)
        if self._finished:
            outputs.finished[:0], self._finished = self._finished, []
        if self.structured is not None and outputs.stats is not None:
            outputs.stats.grammar_mask_seconds = self.structured.mask_seconds
            outputs.stats.grammar_mask_steps = self.structured.mask_steps
        events = self.scheduler.take_kv_events()
        if self.event_publisher is not None:
            self.event_publisher.publish(events)
        return self.held.filter(outputs)

    def _run_step(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """One step through the executor: at once, or the oldest in flight after filling the
        batch queue."""
        depth = self._queue_depth()
        queue = self._batch_queue
        if depth == 1 and not queue:
            scheduler_output, grammar_bitmask = self._schedule()
            return scheduler_output, self.executor.execute(scheduler_output, grammar_bitmask)
        executor: PipelinedExecutor = self.executor  # type: ignore[assignment]
        while len(queue) < depth and (not queue or self.scheduler.has_unscheduled_work()):
            scheduler_output, grammar_bitmask = self._schedule()
            executor.submit(scheduler_output, grammar_bitmask)
            queue.append(scheduler_output)
        scheduler_output = queue.popleft()
        return scheduler_output, executor.collect(scheduler_output.step)

    def _queue_depth(self) -> int:
        if self.async_scheduling and self.structured is not None and self.structured.matchers:
            return 1
        return self.queue_depth

    def _schedule(self) -> tuple[SchedulerOutput, Callable[[], bytes] | None]:
        """The next step, and what fills its grammar masks if it has constrained rows."""
        scheduler_output = self.scheduler.schedule()
        constrained = self._constrained_rows(scheduler_output)
        if not constrained:
            return scheduler_output, None
        rows, masked = zip(*constrained)
        scheduler_output.structured_rows = pack_handles(list(rows))
        return scheduler_output, lambda: self._fill_bitmask(list(masked))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, so the next requests compute their prompts afresh (blocks
        that running requests hold stay theirs). The CPU offload tier keeps its copies."""
        self.scheduler.kv.reset_prefix_cache()
        if self.event_publisher is not None:
            self.event_publisher.publish(self.scheduler.take_kv_events())

    def _admit_compiled(self) -> None:
        assert self.structured is not None
        ready, failed = self.structured.take_compiled()
        for request_id in ready:
            self.scheduler.add_request(self._awaiting_grammar.pop(request_id))
            if request_id not in self.scheduler.requests:  # refused at admission
                self.structured.remove(request_id)
        for request_id, reason in failed:
            del self._awaiting_grammar[request_id]
            self.scheduler.reject(request_id, reason)

    def _constrained_rows(self, scheduler_output: SchedulerOutput) -> list[tuple[int, tuple[str, list[int]]]]:
        """(batch position, (request id, drafts)) of the rows that sample under a grammar this
        step: a prefill chunk that does not end its prompt samples nothing; a row verifying
        drafts samples after its last token and after each draft."""
        if self.structured is None or not self.structured.matchers:
            return []
        matchers = self.structured.matchers
        drafts = scheduler_output.cached.draft_token_ids
        return [
            (row, (request.request_id, unpack_tokens(drafts[request.handle]).tolist() if request.num_drafts else []))
            for row, request in enumerate(self.scheduler.scheduled_requests)
            if request.request_id in matchers
            and request.num_computed_tokens == len(request.all_token_ids) + request.num_drafts
        ]

    def _fill_bitmask(self, rows: list[tuple[str, list[int]]]) -> bytes:
        assert self.structured is not None
        started = time.perf_counter()
        bitmask = self.structured.fill_bitmask(rows)
        self.structured.mask_seconds += time.perf_counter() - started
        self.structured.mask_steps += 1
        return bitmask

    def _advance_matchers(self, outputs: EngineCoreOutputs) -> None:
        """Feed the sampled tokens to their matchers; finish requests whose grammar completed."""
        structured = self.structured
        assert structured is not None
        finished_now = {f.request_id for f in outputs.finished}
        stopped, broken = [], []
        for request_id, token in zip(outputs.request_ids, outputs.new_token_ids):
            if request_id not in structured.matchers or request_id in finished_now:
                continue
            verdict = structured.advance(request_id, token)
            if verdict is not None:
                finished_now.add(request_id)  # a verified step's later tokens, if any, are not fed
            if verdict == "stop":
                stopped.append(request_id)
            elif verdict == "error":
                broken.append(request_id)
        self.scheduler.stop_requests(stopped)
        for request_id in broken:
            self.scheduler.abort_requests([request_id], f"the sampled token broke the grammar: {structured.error_of(request_id)}")
        outputs.finished.extend(self.scheduler.take_finished())
        for finished in outputs.finished:
            structured.remove(finished.request_id)

    def stats(self) -> dict[str, float]:
        """Executor timings, plus the time spent filling grammar masks per constrained step."""
        stats = dict(self.executor.stats())
        if self.structured is not None and self.structured.mask_steps:
            stats["grammar_mask_us_per_step"] = self.structured.mask_seconds / self.structured.mask_steps * 1e6
        return stats

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
        self.executor.shutdown()
