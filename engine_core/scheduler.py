"""The token-budget scheduler: one rule for prefill, chunked prefill, decode and resumption.

Every request has ``num_tokens`` (prompt + generated) and ``num_computed_tokens``; a step
hands each chosen request up to the remaining budget so the computed count catches up.
Running requests go first, in queue order; then waiting ones while budget, sequence slots
and KV blocks last. When blocks run out, the last running request (lowest priority, or
latest arrival under FCFS) is preempted by recompute. Under the priority policy, a waiting
request that outranks the last running one and does not fit preempts it too.

With pipeline parallelism up to ``pipeline_depth`` steps (micro-batches) are in flight at once:
``schedule`` may run again before earlier steps' outputs are back, a request is in at most one
of them (one in flight is neither scheduled nor preempted), and the running requests are shared
out so that the micro-batches are of similar size.

With asynchronous scheduling the next step is scheduled while the workers run the last one, and
a decoding request is in both: its computed count runs one token ahead of the tokens known here,
and the step feeds it the token its step in flight samples, which the workers know by then. A
request that finishes on that token (a stop token) has computed one row for nothing, dropped
when the output comes back; one that the token ends by length is not scheduled again. Each step
in flight remembers how far it brings every row (``ScheduledStep``): a row samples a token iff
that reaches the request's known tokens when its output comes back in order.

With LoRA adapters (``max_loras`` > 0) a request runs only while its adapter holds a slot of
the workers' pool (``lora_slots.py``); one whose adapter finds none waits while requests behind
it that can run go ahead, until it has waited ``starvation_steps``: then no later request
joins a slot, so the slots drain and the next one to fall idle is its. An adapter the workers
could not load (its files went missing after the frontend checked them) fails its requests, and
that load is refused from then on.
"""

import heapq
from collections import Counter
from collections.abc import Callable
from bisect import insort
from dataclasses import dataclass, field

import msgspec

from strata.engine_core.block_pool import KVCacheBlock
from strata.engine_core.kv_cache_manager import KVCacheManager
from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.kv_events import KVEvent
from strata.engine_core.lora_slots import LoRASlots
from strata.engine_core.ngram_proposer import NgramProposer
from strata.engine_core.protocol import (
    EngineCoreOutputs,
    FinishedRequest,
    LoRAAdapter,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
    pack_handles,
    pack_tokens,
    unpack_tokens,
)
from strata.engine_core.request import FINISH_REASONS, Request, RequestStatus
from strata.engine_core.speculative import Proposer, SpeculativeConfig, WorkerDrafts

MAX_HANDLES = 1 << 16
SCHEDULING_POLICIES = ("fcfs", "priority")
RUNNING = RequestStatus.RUNNING
BOOSTED = float("-inf")


@dataclass
class SchedulerConfig:
    """Step budgets and policies. ``starvation_steps``: a waiting request at the head of the
    queue that has been passed over for this many steps while others ran may preempt one.
    ``speculative``: how decoding requests get drafts to verify (off by default).
    ``pipeline_depth``: steps that may be in flight at once (the pipeline's stages).
    ``max_loras``: slots of the workers' LoRA adapter pool, so adapters in one step (0: LoRA
    off, requests naming an adapter are refused). ``async_scheduling``: the EngineCore schedules
    a step while the workers run the one before (an executor that takes steps ahead; one pipeline
    stage, no speculative decoding)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    block_size: int = 16
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    starvation_steps: int | None = 1000
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    pipeline_depth: int = 1
    max_loras: int = 0
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.async_scheduling and (self.pipeline_depth > 1 or self.speculative.method is not None):
            raise ValueError(
                "async_scheduling needs one pipeline stage and no speculative decoding: the next step "
                "is scheduled before the tokens that micro-batches or drafts would need are back"
            )
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "pipeline_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_seqs > MAX_HANDLES // 2:
            raise ValueError(f"max_num_seqs must be <= {MAX_HANDLES // 2}, got {self.max_num_seqs}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if self.starvation_steps is not None and self.starvation_steps < 1:
            raise ValueError(f"starvation_steps must be >= 1 or None, got {self.starvation_steps}")


@dataclass
class ScheduledStep:
    """A step in flight: its requests in batch order and, per row, the computed count the step
    brings the request to (-1: the request was preempted since, and the row's token is void)."""

    requests: list[Request]
    ends: list[int]

    def void(self, request: Request) -> None:
        for row, scheduled in enumerate(self.requests):
            if scheduled is request:
                self.ends[row] = -1


class Scheduler:
    """Decides, each step, which requests run and with how many tokens.

    Drive it with ``add_request``/``abort_requests``, then per step ``schedule()`` ->
    run the model -> ``update_from_output()``, which returns the step's outputs.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        connector: SchedulerConnector | None = None,
        record_kv_events: bool = False,
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, record_kv_events)
        self.connector = connector or SchedulerConnector()
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, Request]] = []  # heap; aborted entries are skipped
        self.num_waiting = 0
        self._lora_waiting: Counter[str] = Counter()  # waiting requests by adapter name, none at 0
        self._arrivals = 0
        self._step = 0
        self._in_flight: dict[int, ScheduledStep] = {}  # until its output comes back
        self._collected_step = 0  # the last step whose output came back
        # Held blocks (a connector's copies still read them; free within a step or so) that
        # requests short of blocks are waiting for this step, instead of preempting more.
        self._awaited_held_blocks = 0
        # Handles of finished requests stay reserved for a step, so twice max_num_seqs suffice.
        self._free_handles = list(range(config.max_num_seqs * 2 - 1, -1, -1))
        self._released_handles: list[int] = []  # finished; the workers hear of it next step
        self._pending_finished: list[FinishedRequest] = []
        self._loaded: set[str] = set()
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0
        # With a draft model the workers propose: their drafts come back with each step's output.
        self.worker_drafts = WorkerDrafts() if config.speculative.method == "draft" else None
        self.proposer: Proposer | None = self.worker_drafts
        if config.speculative.method == "ngram":
            self.proposer = NgramProposer(config.speculative)
        self.spec = SpecDecodeStats(config.speculative.num_speculative_tokens)
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None
        # Adapter loads the workers could not do, lora_id -> why: their requests are refused,
        # since blocks their rows computed (with whatever the slot held) carry their hashes.
        self._failed_loras: dict[int, str] = {}

    # ---- requests in -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or finish it with ``error`` at once if it can never run."""
        error = self._admission_error(request)
        if error is not None:
            request.status = RequestStatus.ERROR
            self.reject(request.request_id, error)
            return
        params = request.sampling_params
        request.stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos or request.eos_token_id is None else {request.eos_token_id}
        )
        request.max_num_tokens = min(request.num_prompt_tokens + params.max_tokens, self.config.max_model_len)
        self._arrivals += 1
        if self.config.policy == "priority":
            request.queue_key = (request.priority, request.arrival_time, self._arrivals)
        else:
            request.queue_key = (0, 0.0, self._arrivals)
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def take_finished(self) -> list[FinishedRequest]:
        """Finished requests not yet reported (``update_from_output`` includes them)."""
        finished, self._pending_finished = self._pending_finished, []
        return finished

    def reject(self, request_id: str, message: str) -> None:
        """Report a request that never entered the queues as finished with ``error``."""
        self._pending_finished.append(FinishedRequest(request_id, "error", message))

    def _admission_error(self, request: Request) -> str | None:
        prompt_len = request.num_prompt_tokens
        if request.request_id in self.requests:
            return f"request id {request.request_id!r} is already in use"
        if prompt_len == 0:
            return "the prompt is empty"
        if request.lora is not None and self.lora_slots is None:
            return f"the request names LoRA adapter {request.lora.name!r} but this engine serves no adapters"
        if request.lora is not None and request.lora.lora_id in self._failed_loras:
            return self._failed_loras[request.lora.lora_id]
        if prompt_len > self.config.max_model_len:
            return (
                f"the prompt has {prompt_len} tokens, more than max_model_len "
                f"({self.config.max_model_len})"
            )
        if self.kv.blocks_needed(prompt_len) > self.kv.num_blocks:
            return (
                f"the prompt needs {self.kv.blocks_needed(prompt_len)} KV blocks but the "
                f"cache has only {self.kv.num_blocks}"
            )
        return None

    def abort_requests(self, request_ids: list[str], message: str | None = None) -> None:
        """Finish the named requests with ``abort`` (``error`` if a message is given).
        Unknown or already finished ids are ignored."""
        status = RequestStatus.ERROR if message else RequestStatus.ABORTED
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                if request.status != RequestStatus.RUNNING:
                    self._count_waiting(request, -1)
                self._finish(request, status, message)
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finish running requests with ``stop`` (their grammar is complete)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.status == RUNNING:
                self._finish(request, RequestStatus.STOPPED)
        self.running = [r for r in self.running if r.status == RUNNING]

    @property
    def scheduled_requests(self) -> list[Request]:
        """The last scheduled step's requests in batch order, until its ``update_from_output``."""
        step = self._in_flight.get(self._step)
        return [] if step is None else step.requests

    def has_unscheduled_work(self) -> bool:
        """Whether a step scheduled now could run anything: a waiting request, or a running one
        not in flight (pipeline stages) whose step in flight, if any, does not end it by length
        (asynchronous scheduling)."""
        return self.num_waiting > 0 or any(
            not request.in_flight and not request.ended_by_token_in_flight for request in self.running
        )

    def has_work(self) -> bool:
        """Requests to run, outputs to deliver, or blocks a connector copy still holds (the
        copy's completion arrives only with a step). Released handles alone wait for a real step."""
        return bool(self.requests or self._pending_finished or self.kv.held)

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        output = SchedulerOutput(step=self._step, finished_handles=self._released_handles)
        self._free_handles.extend(self._released_handles)
        self._released_handles = []
        self._awaited_held_blocks = 0
        self._guard_starvation(output)
        self._preempt_for_priority(output)

        preempted_by_guard = len(output.preempted_handles)
        budget = self.config.max_num_batched_tokens
        scheduled_running, used = self._schedule_running(output, budget)
        scheduled_new: list[Request] = []
        used_by_new = 0
        if len(output.preempted_handles) == preempted_by_guard:  # no admissions after a squeeze
            scheduled_new, used_by_new = self._schedule_waiting(output, budget - used)
        scheduled = scheduled_new + scheduled_running
        self._in_flight[self._step] = ScheduledStep(scheduled, [request.num_computed_tokens for request in scheduled])
        if self.config.pipeline_depth > 1:
            for request in scheduled:
                request.in_flight = True
            output.collected_step = self._collected_step
        output.total_num_scheduled_tokens = used + used_by_new
        output.propose_drafts = self.config.speculative.speculates_at(len(self.running))
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> tuple[list[Request], int]:
        # The hot path: at steady decode this loop runs for every running request every step.
        # Preemption pops from the back of ``running``, which this iteration has not reached.
        start_budget = budget
        scheduled: list[Request] = []
        handles: list[int] = []
        schedule_request, add_handle = scheduled.append, handles.append
        multi_token = output.cached.num_tokens
        new_block_ids = output.cached.new_block_ids
        dropped = False
        # In a pipeline, this micro-batch takes its share of the running requests.
        share = -(-len(self.running) // self.config.pipeline_depth)
        speculating = self.proposer is not None and self.config.speculative.speculates_at(len(self.running))
        for request in self.running:
            if budget == 0 or len(handles) == share:
                break
            if request.in_flight:
                continue
            computed = request.num_computed_tokens
            num_new = len(request.all_token_ids) - computed
            if num_new == 0:
                # Asynchronous scheduling: its step in flight samples the token this one feeds.
                if request.ended_by_token_in_flight:
                    continue
                num_new = 1
            drafts = None
            if num_new == 1 and speculating and budget > 1:
                drafts = self._propose(request, budget - 1)
                num_new += len(drafts)
            if num_new > budget:
                num_new = budget
            if computed + num_new > request.kv_fast_limit:
                new_blocks = self._allocate_or_preempt(request, num_new, output)
                if new_blocks is None:  # it failed, or preempted itself (then it was the last)
                    dropped = True
                    continue
                if new_blocks:
                    new_block_ids[request.handle] = [block.block_id for block in new_blocks]
            if request.blocks_kept is not None:  # before any block this step appends
                output.cached.kept_blocks[request.handle] = request.blocks_kept
                request.blocks_kept = None
            if num_new != 1:
                multi_token[request.handle] = num_new
                if drafts:
                    output.cached.draft_token_ids[request.handle] = pack_tokens(drafts)
                    request.num_drafts = len(drafts)
            if computed < request.num_prompt_tokens:  # a chunk of its prompt, drafts or not after it
                self.prompt_tokens_computed += min(num_new, request.num_prompt_tokens - computed)
            request.num_computed_tokens = computed + num_new
            add_handle(request.handle)
            schedule_request(request)
            budget -= num_new
        if dropped:
            self.running = [r for r in self.running if r.status == RUNNING]
        output.cached.handles = pack_handles(handles)
        return scheduled, start_budget - budget

    def _pop_preemptable(self) -> Request | None:
        """Take the last running request that is not in flight out of ``running``."""
        index = self._last_preemptable()
        return None if index is None else self.running.pop(index)

    def _last_preemptable(self) -> int | None:
        for index in range(len(self.running) - 1, -1, -1):
            if not self.running[index].in_flight:
                return index
        return None

    def _propose(self, request: Request, room: int) -> list[int]:
        """Drafts for a decoding request: at most ``room`` (the budget left after its token),
        none that would run past its length limit."""
        assert self.proposer is not None
        return self.proposer.propose(request, min(room, request.max_num_tokens - len(request.all_token_ids) - 1))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, output: SchedulerOutput
    ) -> list[KVCacheBlock] | None:
        """Blocks for a running request, preempting from the back of ``running`` until they
        fit. None if the request itself was preempted, can never fit (then it is finished with
        an error but still in ``running``: the caller filters), or waits this step for blocks a
        connector's copy still holds (it stays running): preempting more would free nothing
        sooner than those copies finish."""
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            needed = self.kv.blocks_needed(request.num_computed_tokens + num_new)
            if needed > self.kv.num_blocks:
                self._finish_unfittable(request)
                return None
            missing = needed - len(self.kv.get_block_ids(request.request_id)) - self.kv.num_free_blocks
            if missing <= self.kv.num_releasable_blocks - self._awaited_held_blocks:
                self._awaited_held_blocks += missing
                return None
            victim = self._pop_preemptable()  # never None: ``request`` itself is not in flight
            assert victim is not None
            self._preempt(victim, output)
            if victim is request:
                return None

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> tuple[list[Request], int]:
        start_budget = budget
        scheduled: list[Request] = []
        deferred: list[Request] = []
        # Once a request finds no room the queue stops there, except for requests whose KV
        # finished loading: they hold every block they need already, and the one that found no
        # room may be waiting for exactly those blocks.
        head_blocked = False
        # Set once a request has waited too long for an adapter slot: then no later request
        # joins a slot either, so the slots drain and the next one to fall idle is its.
        lora_draining = False
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if head_blocked and not self._loaded:
                break
            request = self._pop_waiting()
            if request is None:
                break
            loaded = request.request_id in self._loaded
            if not loaded and (head_blocked or request.status == RequestStatus.WAITING_FOR_KV):
                deferred.append(request)
                continue
            if request.lora is not None and (lora_draining or not self._slot_for(request.lora)):
                # Requests behind it that can run go ahead: the base model, adapters in a slot.
                request.lora_waits += 1
                limit = self.config.starvation_steps
                lora_draining |= limit is not None and request.lora_waits > limit
                deferred.append(request)
                continue
            if self.kv.blocks_needed(request.num_tokens) > self.kv.num_blocks:
                # Resumed with more tokens than the whole pool holds: it would wait forever.
                self._finish_unfittable(request)
                continue
            if loaded:
                self._loaded.discard(request.request_id)
                self.kv.cache_blocks(request, request.num_computed_tokens)
            num_new = self._admit(request, budget, output)
            if num_new is None:
                deferred.append(request)
                head_blocked = True
                continue
            if num_new == 0:  # an asynchronous load started, or the connector must be asked again
                deferred.append(request)
                continue
            scheduled.append(request)
            budget -= num_new
        for request in deferred:
            self._push_waiting(request)
        if self._waiting and self.running and not scheduled:
            head = self._peek_waiting()
            if head is not None:
                head.waited_steps += 1
        return scheduled, start_budget - budget

    def _slot_for(self, adapter: LoRAAdapter) -> bool:
        assert self.lora_slots is not None  # admission refused adapters without slots
        return self.lora_slots.can_acquire(adapter)

    def _admit(self, request: Request, budget: int, output: SchedulerOutput) -> int | None:
        """Allocate and start a waiting request. Returns the tokens scheduled for it, 0 if it
        must keep waiting for the connector, or None if the pool has no room."""
        computed_blocks, num_external, load_async = [], 0, False
        if request.status != RequestStatus.WAITING_FOR_KV and not request.needs_prompt_logprobs:
            computed_blocks, num_local = self.kv.get_computed_blocks(request)
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
            if num_external is None:
                return 0
        num_computed = (
            request.num_computed_tokens + len(computed_blocks) * self.config.block_size + num_external
        )
        num_new = 0 if load_async else min(request.num_tokens - num_computed, budget)
        # An async load also reserves blocks for the tokens left to compute: requests waiting
        # for KV are never preempted, so if they needed more blocks once loaded they could
        # fill the pool and wait for each other forever.
        num_reserved = request.num_tokens - num_computed if load_async else num_new
        new_blocks = self.kv.allocate_slots(
            request, num_reserved, computed_blocks, num_external, delay_caching=load_async
        )
        if new_blocks is None:
            return None
        block_ids = self.kv.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        if request.num_cached_tokens < 0:  # its first admission: retries and resumptions do not count
            request.num_cached_tokens = num_computed
            if self.config.enable_prefix_caching:
                self.kv.prefix_stats.record(request.num_tokens, len(computed_blocks) * self.config.block_size)
        if load_async:
            request.status = RequestStatus.WAITING_FOR_KV
            request.num_computed_tokens = num_computed
            return 0

        request.status = RequestStatus.RUNNING
        request.waited_steps = 0
        request.handle = self._free_handles.pop()
        if request.lora is not None:
            assert self.lora_slots is not None
            request.lora_slot = self.lora_slots.acquire(request.lora, output.lora_loads)
            request.lora_waits = 0
        insort(self.running, request, key=_queue_key)
        if num_computed < request.num_prompt_tokens:
            self.prompt_tokens_computed += min(num_new, request.num_prompt_tokens - num_computed)
        params = request.sampling_params
        if params.prompt_logprobs is not None and not request.needs_prompt_logprobs:
            params = msgspec.structs.replace(params, prompt_logprobs=None)  # resumed: sent already
        output.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                handle=request.handle,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=params,
                eos_token_id=request.eos_token_id,
                block_ids=block_ids,
                num_computed_tokens=num_computed,
                num_scheduled_tokens=num_new,
                lora_slot=request.lora_slot,
            )
        )
        request.num_computed_tokens = num_computed + num_new
        return num_new

    def _finish_unfittable(self, request: Request) -> None:
        needed = self.kv.blocks_needed(request.num_tokens)
        self._finish(
            request,
            RequestStatus.ERROR,
            f"the request needs {needed} KV blocks for {request.num_tokens} tokens but the "
            f"cache has only {self.kv.num_blocks}; it cannot run even alone",
        )

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Free a running request's blocks and send it back to wait (recompute later)."""
        self._release_blocks(request, self.connector.request_preempted)
        output.preempted_handles.append(request.handle)
        self._free_handles.append(request.handle)
        request.handle = -1
        self._release_lora_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.blocks_kept = None  # it comes back with a table of its own
        for step in self._in_flight.values():  # asynchronous scheduling: it may be in one
            step.void(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _guard_starvation(self, output: SchedulerOutput) -> None:
        """Let a long-starved waiting head jump the queue and take a running request's place."""
        limit = self.config.starvation_steps
        head = self._peek_waiting()
        victim = self._last_preemptable()
        if limit is None or head is None or victim is None or head.waited_steps <= limit:
            return
        if self.running[victim].queue_key[0] == BOOSTED:
            return  # boosted requests are never squeezed out again: no ping-pong livelock
        if head.queue_key[0] != BOOSTED:
            self._pop_waiting()
            head.queue_key = (BOOSTED, float(self._step), head.queue_key[2])
            self._push_waiting(head)
        head.waited_steps = 0
        self._preempt(self.running.pop(victim), output)

    def _preempt_for_priority(self, output: SchedulerOutput) -> None:
        """Under the priority policy, preempt from the back of ``running`` while the waiting
        head outranks that request and would not fit (as vLLM does). Queue keys are a strict
        total order that only the starvation guard changes (upwards, to BOOSTED), so a
        preempted request never outranks the one that took its place: no ping-pong."""
        if self.config.policy != "priority":
            return
        head = self._peek_waiting()
        if head is None or head.status == RequestStatus.WAITING_FOR_KV:
            return
        if head.lora is not None and not self._slot_for(head.lora):
            return  # preempting frees a slot only with its adapter's last request: none is made
        while True:
            victim = self._last_preemptable()
            if victim is None or head.queue_key >= self.running[victim].queue_key or self._would_fit(head):
                return
            self._preempt(self.running.pop(victim), output)

    def _would_fit(self, request: Request) -> bool:
        """Whether a waiting request would be admitted this step: a sequence slot, and blocks
        for the chunk the budget the running requests leave would give it."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        running_tokens = sum(len(r.all_token_ids) - r.num_computed_tokens for r in self.running)
        budget = max(1, self.config.max_num_batched_tokens - running_tokens)
        hits, num_hit = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, budget)
        hits_in_free_queue = sum(1 for block in hits if block.ref_count == 0)
        needed = self.kv.blocks_needed(num_hit + num_new) - len(hits) + hits_in_free_queue
        return needed <= self.kv.num_free_blocks

    # ---- the waiting queue ---------------------------------------------------------------

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (request.queue_key, request))
        self._count_waiting(request, 1)

    def _pop_waiting(self) -> Request | None:
        while self._waiting:
            request = heapq.heappop(self._waiting)[1]
            if not request.finished:
                self._count_waiting(request, -1)
                return request
        return None

    def _count_waiting(self, request: Request, change: int) -> None:
        self.num_waiting += change
        if request.lora is not None:
            name = request.lora.name
            self._lora_waiting[name] += change
            if not self._lora_waiting[name]:
                del self._lora_waiting[name]

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][1].finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][1] if self._waiting else None

    # ---- results in ----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, apply stop rules, free finished requests, and return
        what the frontend must hear about this step."""
        if runner_output.step != scheduler_output.step or scheduler_output.step not in self._in_flight:
            raise ValueError(
                f"output of step {runner_output.step} does not answer a step in flight ({sorted(self._in_flight)})"
            )
        tokens = unpack_tokens(runner_output.sampled_token_ids)
        step = self._in_flight.pop(scheduler_output.step)
        scheduled = step.requests
        self._collected_step = scheduler_output.step
        for request in scheduled:
            request.in_flight = False
        if len(tokens) != len(scheduled):
            raise ValueError(f"{len(tokens)} sampled tokens for {len(scheduled)} scheduled requests")
        if runner_output.lora_load_errors:  # before the tokens, which such rows must not get
            self._fail_adapters(runner_output.lora_load_errors)
        request_ids: list[str] = []
        new_token_ids: list[int] = []
        logprobs: dict[str, list[TokenLogprobs]] = {}
        # Before the tokens: a request that finishes this step still gets its last prompt logprobs.
        prompt_logprobs = self._new_prompt_logprobs(step, runner_output) if runner_output.prompt_logprobs else {}
        verified = (
            {scheduled[row].request_id: unpack_tokens(ids) for row, ids in runner_output.verified_token_ids.items()}
            if runner_output.verified_token_ids else {}
        )
        any_finished = False
        num_taken: dict[str, int] = {}  # of a verified step's tokens, up to the one that stopped
        for request, end, token in zip(scheduled, step.ends, tokens):
            if request.num_drafts:
                num_taken[request.request_id] = taken = self._accept_verified(
                    request, verified[request.request_id], request_ids, new_token_ids
                )
                any_finished |= taken > 0 and request.status != RUNNING
                continue
            if end != len(request.all_token_ids) or request.status != RUNNING:
                continue  # a prefill chunk that does not end the prompt, or finished or preempted meanwhile
            if not request.output_token_ids and request.sampling_params.max_tokens == 0:
                self._finish(request, RequestStatus.LENGTH)  # its prompt computed: all it asked
                any_finished = True
                continue
            request_ids.append(request.request_id)
            new_token_ids.append(token)
            any_finished |= self._append_token(request, token)
        if runner_output.logprobs:
            took_tokens = set(request_ids)  # not a row whose request finished meanwhile
            for row, row_logprobs in runner_output.logprobs.items():
                request_id = scheduled[row].request_id
                if request_id in took_tokens:
                    logprobs[request_id] = row_logprobs[: num_taken[request_id]] if request_id in num_taken else row_logprobs
        if runner_output.draft_token_ids:
            self._receive_drafts(scheduled, runner_output.draft_token_ids)
        if any_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if runner_output.kv_connector_output is not None:
            self._update_transfers(runner_output)
        return EngineCoreOutputs(
            request_ids, new_token_ids, logprobs, self.take_finished(), self.stats(), prompt_logprobs
        )

    def _receive_drafts(self, scheduled: list[Request], draft_token_ids: dict[int, bytes]) -> None:
        """Keep the drafts the workers' draft model proposed after this step, for the requests'
        next steps (after their tokens were appended: the drafts continue those)."""
        if self.worker_drafts is None:
            raise ValueError("the workers proposed drafts, but this engine's speculative method is not draft")
        for row, packed in draft_token_ids.items():
            request = scheduled[row]
            if request.status == RUNNING:
                self.worker_drafts.receive(request, unpack_tokens(packed).tolist())

    def _fail_adapters(self, errors: dict[int, str]) -> None:
        """Finish every request of the adapter loads the workers could not do with the reason,
        refuse later ones, and empty their slots."""
        assert self.lora_slots is not None
        self._failed_loras.update(errors)
        for lora_id, why in errors.items():
            ids = [r.request_id for r in self.requests.values() if r.lora is not None and r.lora.lora_id == lora_id]
            self.abort_requests(ids, why)
            self.lora_slots.forget(lora_id)

    def _append_token(self, request: Request, token: int) -> bool:
        """Add a generated token and apply the stop rules to it; True if the request finished."""
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
        if token in request.stop_ids and len(request.output_token_ids) >= request.sampling_params.min_tokens:
            request.stop_token_id = token
            self._finish(request, RequestStatus.STOPPED)
            return True
        if len(request.all_token_ids) >= request.max_num_tokens:
            self._finish(request, RequestStatus.LENGTH)
            return True
        return False

    def _accept_verified(
        self, request: Request, produced: list[int], request_ids: list[str], new_token_ids: list[int]
    ) -> int:
        """Take a verified step's tokens (the accepted drafts, then the model's own) one by one
        until one stops the request; the rejected drafts' KV slots are given back. Returns how
        many it took."""
        num_drafts, request.num_drafts = request.num_drafts, 0
        if request.status != RUNNING:
            return 0  # aborted meanwhile
        num_accepted = len(produced) - 1
        self.spec.record(num_drafts, num_accepted)
        # Computed: every position but the newest token's; the rejected drafts' KV is garbage.
        request.num_computed_tokens -= num_drafts - num_accepted
        for taken, token in enumerate(produced, 1):
            request_ids.append(request.request_id)
            new_token_ids.append(token)
            if self._append_token(request, token):
                return taken
        kept = self.kv.free_tail(request, len(request.all_token_ids))
        if kept is not None:
            request.blocks_kept = kept
        return len(produced)

    @staticmethod
    def _new_prompt_logprobs(step: ScheduledStep, runner_output: ModelRunnerOutput) -> dict[str, PromptLogprobs]:
        """The step's prompt logprobs that were not sent before: a request preempted in its
        prompt computes it again from the start."""
        new = {}
        for row, computed in runner_output.prompt_logprobs.items():
            request = step.requests[row]
            if request.status != RUNNING or step.ends[row] < 0:
                continue  # finished or preempted meanwhile
            repeated = request.num_prompt_logprobs_sent - (computed.first_position - 1)
            if repeated > 0:
                computed = computed.skip(repeated)
            if computed.num_positions:
                new[request.request_id] = computed
                request.num_prompt_logprobs_sent += computed.num_positions
        return new

    def _update_transfers(self, runner_output: ModelRunnerOutput) -> None:
        connector_output = runner_output.kv_connector_output
        assert connector_output is not None
        loaded, released = self.connector.update_connector_output(connector_output)
        self._loaded.update(request_id for request_id in loaded if request_id in self.requests)
        for key in released:
            self.kv.release(key)

    def _finish(self, request: Request, status: RequestStatus, message: str | None = None) -> None:
        """Mark a request finished and release it; the caller removes it from ``running``."""
        if request.status == RequestStatus.WAITING_FOR_KV and request.request_id not in self._loaded:
            request.num_computed_tokens = 0  # its load has not landed: keep its blocks out of the prefix cache
        request.status = status
        request.error = message
        del self.requests[request.request_id]
        self._loaded.discard(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        if request.handle >= 0:
            self._released_handles.append(request.handle)
            request.handle = -1
        self._release_lora_slot(request)
        self._release_blocks(request, self.connector.request_finished)
        self._pending_finished.append(
            FinishedRequest(request.request_id, FINISH_REASONS[status], message, request.stop_token_id)
        )

    def _release_lora_slot(self, request: Request) -> None:
        if request.lora_slot >= 0:
            assert self.lora_slots is not None
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1

    def _release_blocks(self, request: Request, ask_connector: Callable[[Request, list[int]], str | None]) -> None:
        """Free a request's blocks, or hold them if the connector says a copy still uses them."""
        hold_key = ask_connector(request, self.kv.get_block_ids(request.request_id))
        if hold_key is None:
            self.kv.free(request)
        else:
            self.kv.hold(request, hold_key)

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's KV events (if recorded) and the connector's, since the last call."""
        return self.kv.pool.take_events() + self.connector.take_events()

    def stats(self) -> SchedulerStats:
        prefix = self.kv.prefix_stats
        lora_running = (
            Counter(r.lora.name for r in self.running if r.lora is not None) if self.lora_slots is not None else {}
        )
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=prefix.queried_tokens,
            prefix_cache_hits=prefix.hit_tokens,
            num_preemptions=self.num_preemptions,
            prompt_tokens_computed=self.prompt_tokens_computed,
            **self.connector.scheduler_stats(),
            spec_draft_tokens=self.spec.draft_tokens,
            spec_accepted_tokens=self.spec.accepted_tokens,
            spec_verifications=self.spec.verifications,
            spec_accepted_by_position=list(self.spec.accepted_by_position),
            lora_running=dict(lora_running),
            lora_waiting=dict(self._lora_waiting),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the KV pool or the queues are inconsistent (for tests)."""
        self.kv.check_invariants()
        running_ids = {r.request_id for r in self.running}
        holders = set(self.kv.req_to_blocks)
        waiting_with_blocks = {
            r.request_id for _, r in self._waiting if r.status == RequestStatus.WAITING_FOR_KV and not r.finished
        }
        if not holders <= running_ids | waiting_with_blocks:
            raise AssertionError(f"blocks held by requests that are not running: {holders - running_ids}")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError("more running requests than max_num_seqs")
        if self.num_waiting != sum(1 for _, r in self._waiting if not r.finished):
            raise AssertionError("num_waiting does not match the waiting queue")
        if self.lora_slots is not None:
            self.lora_slots.check_invariants([r.lora_slot for r in self.running if r.lora is not None])
        waiting_loras = Counter(r.lora.name for _, r in self._waiting if not r.finished and r.lora is not None)
        if waiting_loras != self._lora_waiting:
            raise AssertionError(f"waiting by adapter {dict(self._lora_waiting)}, but the queue holds {dict(waiting_loras)}")


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counts since start (``SchedulerStats`` carries them out)."""

    num_speculative_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_by_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.verifications += 1
        for position in range(num_accepted):
            self.accepted_by_position[position] += 1


def _queue_key(request: Request) -> tuple:
    return request.queue_key
