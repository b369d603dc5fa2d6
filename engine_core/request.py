"""A request as the scheduler sees it: tokens so far, how many are computed, and its status."""

import enum
from dataclasses import dataclass, field

from strata.engine_core.protocol import LoRAAdapter
from strata.engine_core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_KV = 1  # an external KV load (connector) is in flight
    RUNNING = 2
    PREEMPTED = 3
    # Finished states: everything from here on.
    STOPPED = 4
    LENGTH = 5
    ABORTED = 6
    ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.STOPPED


FINISH_REASONS = {
    RequestStatus.STOPPED: "stop",
    RequestStatus.LENGTH: "length",
    RequestStatus.ABORTED: "abort",
    RequestStatus.ERROR: "error",
}


@dataclass(eq=False, slots=True)
class Request:
    """Scheduler-side state of one sequence.

    ``all_token_ids`` is prompt + output; ``num_computed_tokens`` counts the tokens whose KV
    is in the cache (or scheduled into it this step). ``handle`` is the small integer that
    names the request to the workers while it is in their batch (-1 when it is not).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None  # mixed into the first block's hash: no sharing across salts
    lora: LoRAAdapter | None = None  # its adapter (None: the base model); in the hashes too
    lora_slot: int = -1  # the adapter's slot in the workers' pool while it runs; -1 otherwise
    lora_waits: int = 0  # steps it has waited, since it last ran, for its adapter to get a slot
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until then
    num_preemptions: int = 0
    waited_steps: int = 0
    handle: int = -1
    # Set by the KV manager: the request may fill up to this many tokens before the manager
    # has work to do (a new block to hand out, a full block to register).
    kv_fast_limit: int = 0
    # Set at admission: token ids that end the request, and the length at which it stops.
    stop_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0
    queue_key: tuple = ()  # (priority, arrival time, arrival order) under which it queues
    error: str | None = None
    stop_token_id: int | None = None
    num_prompt_logprobs_sent: int = 0  # prompt positions (from 1) whose logprobs went out
    num_drafts: int = 0  # drafts scheduled in the current step
    # Its block table's length after rejected drafts' blocks were given back, until the workers
    # hear it with the request's next scheduled step.
    blocks_kept: int | None = None
    in_flight: bool = False  # pipeline parallelism: in a step whose output is not back yet

    @property
    def ended_by_token_in_flight(self) -> bool:
        """Asynchronous scheduling: its known tokens are all computed, so a step in flight samples
        the next one, and that token brings it to its length limit: no step is left for it."""
        computed = self.num_computed_tokens
        return computed == len(self.all_token_ids) and computed + 1 >= self.max_num_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some are still to compute: until then
        the request computes its prompt itself, from the start."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.num_prompt_logprobs_sent < len(self.prompt_token_ids) - 1
        )

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status >= RequestStatus.STOPPED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
