"""Every message that crosses a socket: msgspec structs with typed decoders, nothing else.

Two conversations:
- frontend <-> EngineCore: ``EngineCoreRequest``/``AbortRequests`` in, ``EngineCoreOutputs`` out;
- EngineCore <-> workers: ``SchedulerOutput`` out (one message per step, to every rank),
  ``ModelRunnerOutput`` back.

Per-step messages are diffs. A request's prompt and sampling parameters cross once, in
``NewRequestData``; afterwards a running request is named by its ``handle`` (a small integer
the scheduler reuses, < 65536) and costs two bytes per step while it decodes.
"""

from array import array

import msgspec

from strata.engine_core.sampling_params import SamplingParams

HANDLE_TYPECODE = "H"  # uint16 handles, packed little-endian into bytes
TOKEN_TYPECODE = "i"  # int32 token ids
LOGPROB_TYPECODE = "f"  # float32 logprobs


def pack_handles(handles: list[int]) -> bytes:
    return array(HANDLE_TYPECODE, handles).tobytes()


def unpack_handles(data: bytes) -> array:
    handles = array(HANDLE_TYPECODE)
    handles.frombytes(data)
    return handles


def pack_tokens(tokens: list[int]) -> bytes:
    return array(TOKEN_TYPECODE, tokens).tobytes()


def unpack_tokens(data: bytes) -> array:
    tokens = array(TOKEN_TYPECODE)
    tokens.frombytes(data)
    return tokens


# ---- frontend <-> EngineCore -------------------------------------------------------------


class LoRAAdapter(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter as requests name it: the name it is served under, an id unique to this
    load of it (unloading a name and loading it again gives a new id, so KV computed with the
    old weights is never reused), and its PEFT directory (``adapter_config.json`` and
    ``adapter_model.safetensors``), which every worker reads."""

    name: str
    lora_id: int
    path: str


class EngineCoreRequest(msgspec.Struct, array_like=True, tag="add"):
    """A request from a frontend. ``stream``: its tokens go out with every step's outputs;
    False (a frontend that wants only whole completions) holds them in the EngineCore until
    the request finishes, so that a long generation costs the frontend one message, not one
    per step (``engine_core/held_outputs.py``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None  # requests with different salts never share KV blocks
    lora: LoRAAdapter | None = None  # None: the base model
    stream: bool = True


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The sampled token first, then the top-k alternatives, each with its logprob."""

    token_ids: list[int]
    logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of consecutive prompt tokens, the first at ``first_position`` (>= 1: the first
    prompt token has none). Each position has ``width`` entries: the prompt's own token, then
    the top ``width - 1`` alternatives. ``token_ids`` is packed int32, ``logprobs`` float32."""

    first_position: int
    width: int
    token_ids: bytes
    logprobs: bytes

    @property
    def num_positions(self) -> int:
        return len(self.token_ids) // (4 * self.width)

    def skip(self, count: int) -> "PromptLogprobs":
        """The same without its first ``count`` positions."""
        cut = 4 * self.width * count
        return PromptLogprobs(self.first_position + count, self.width, self.token_ids[cut:], self.logprobs[cut:])

    def entries(self) -> list[dict[int, float]]:
        """Per position: {token id: logprob}, the prompt's own token first."""
        ids, values = unpack_tokens(self.token_ids), array(LOGPROB_TYPECODE)
        values.frombytes(self.logprobs)
        width = self.width
        return [dict(zip(ids[i : i + width], values[i : i + width])) for i in range(0, len(ids), width)]


class FinishedRequest(msgspec.Struct, array_like=True):
    """A request the engine is done with. An ``error`` is the request's fault (refused,
    rejected by its grammar or adapter) unless ``engine_fault``: its engine or data-parallel
    replica failed under it, which the server answers with a 5xx, not a 400. A request that
    did not stream carries when the EngineCore took its first and last tokens (``time.time()``;
    None before any)."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    message: str | None = None
    stop_token_id: int | None = None
    engine_fault: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_computed: int  # tokens prefilled by the model (cache hits excluded)
    offload_queried_tokens: int = 0
    offload_hit_tokens: int = 0
    offload_blocks_stored: int = 0
    offload_blocks_loaded: int = 0
    offload_bytes_moved: int = 0
    offload_transfer_seconds: float = 0.0
    offload_cpu_usage: float = 0.0
    grammar_mask_seconds: float = 0.0  # filling grammar masks, since start (set by the EngineCore)
    grammar_mask_steps: int = 0  # steps with constrained rows, since start
    # Speculative decoding, since start: draft tokens verified, accepted, and the verifications
    # (one per request per step with drafts); ``spec_accepted_by_position[j]``: drafts accepted
    # at position j of their step (all before it were accepted too).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    spec_accepted_by_position: list[int] = []
    # With LoRA adapters on: running and waiting requests by adapter name (adapters with none
    # left out; empty when LoRA is off, so the stats of engines without adapters stay small).
    lora_running: dict[str, int] = {}
    lora_waiting: dict[str, int] = {}

    @classmethod
    def before_any_step(cls) -> "SchedulerStats":
        """An engine's stats until its first step: nothing running, waiting or computed yet."""
        return cls(0, 0, 0.0, 0, 0, 0, 0)


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag="out"):
    """One step's results, as columns: ``new_token_ids[i]`` belongs to ``request_ids[i]`` (a
    request that verified drafts appears once per token, in order).
    ``logprobs`` maps a request id that asked for them to its new tokens' logprobs, one per
    token in order; ``prompt_logprobs`` to the prompt positions this step computed, in order
    across steps."""

    request_ids: list[str] = []
    new_token_ids: list[int] = []
    logprobs: dict[str, list[TokenLogprobs]] = {}
    finished: list[FinishedRequest] = []
    stats: SchedulerStats | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = {}

    @property
    def has_results(self) -> bool:
        """Whether it carries anything for some request (else only the step's stats)."""
        return bool(self.request_ids or self.finished or self.prompt_logprobs)


# ---- EngineCore <-> workers --------------------------------------------------------------


class NewRequestData(msgspec.Struct, array_like=True):
    """A request entering the workers' batch: new, or resumed after preemption (then
    ``output_token_ids`` holds what it generated before)."""

    request_id: str
    handle: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_slot: int = -1  # the slot of the workers' adapter pool its tokens use; -1: none


class CachedRequestData(msgspec.Struct, array_like=True):
    """Requests already in the batch. ``handles`` is packed uint16 in batch order; each is
    scheduled one token unless ``num_tokens`` says otherwise; ``new_block_ids`` lists the
    blocks appended to a request's table this step. ``draft_token_ids``: packed int32 drafts
    (speculative decoding) placed after a request's last token; its scheduled tokens are that
    token and its drafts. ``kept_blocks``: a request's table length after the blocks only its
    rejected drafts used were given back; workers cut its table there before appending."""

    handles: bytes = b""
    num_tokens: dict[int, int] = {}
    new_block_ids: dict[int, list[int]] = {}
    draft_token_ids: dict[int, bytes] = {}
    kept_blocks: dict[int, int] = {}


class BlockTransfer(msgspec.Struct, array_like=True):
    """Copy of KV blocks between the GPU cache and the CPU tier, named for completion."""

    transfer_id: str
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct, array_like=True):
    loads: list[BlockTransfer] = []
    stores: list[BlockTransfer] = []


class LoRASlotLoad(msgspec.Struct, array_like=True):
    """Put ``adapter`` into slot ``slot`` of the workers' adapter pool before the step runs
    (whatever the slot held before is no longer used by any request in the batch)."""

    slot: int
    adapter: LoRAAdapter


class SchedulerOutput(msgspec.Struct, array_like=True, tag="step"):
    """What the workers run this step. Batch order: ``new_requests`` then ``cached``.
    Workers drop ``finished_handles`` and ``preempted_handles`` before adding new requests
    (a handle freed this step may be reused by a new request in the same step)."""

    step: int
    new_requests: list[NewRequestData] = []
    cached: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    total_num_scheduled_tokens: int = 0
    finished_handles: list[int] = []
    preempted_handles: list[int] = []
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Batch positions (packed uint16) whose rows have a grammar: a ``GrammarBitmask`` for this
    # step follows on the same socket, sent while the workers run the forward pass.
    structured_rows: bytes = b""
    # Pipeline parallelism: the last step whose output the EngineCore had when it scheduled this
    # one. The stages before the last take the tokens sampled up to that step from the last
    # stage before they run this one.
    collected_step: int = 0
    lora_loads: list[LoRASlotLoad] = []
    # Whether a draft model proposes after this step: the next step is expected to speculate.
    propose_drafts: bool = False


class GrammarBitmask(msgspec.Struct, array_like=True, tag="mask"):
    """The next-token masks of a step's ``structured_rows``, in that order: one for each
    position a row samples (``1 +`` its drafts: after its last token, then after each draft).
    Packed int32, ``ceil(vocab / 32)`` words per mask; bit ``t % 32`` of word ``t // 32``
    allows token ``t``."""

    step: int
    bitmask: bytes


class KVConnectorOutput(msgspec.Struct, array_like=True):
    """Transfer ids whose copies completed, and the copying done since the last report."""

    finished_sending: list[str] = []
    finished_recving: list[str] = []
    bytes_moved: int = 0
    transfer_seconds: float = 0.0


class ModelRunnerOutput(msgspec.Struct, array_like=True, tag="out"):
    """A step's result from one rank. ``sampled_token_ids`` is packed int32, one per
    scheduled request in batch order (meaningless for a partial prefill chunk).
    ``logprobs`` maps a batch row to the logprobs of each token it produced (one, or with
    verified drafts one per ``verified_token_ids`` token, in order), ``prompt_logprobs`` a row
    to those of the prompt positions its chunk computed."""

    step: int
    rank: int = 0
    sampled_token_ids: bytes = b""
    logprobs: dict[int, list[TokenLogprobs]] = {}
    kv_connector_output: KVConnectorOutput | None = None
    prompt_logprobs: dict[int, PromptLogprobs] = {}
    # Rows that verified drafts: every token their step produced (the accepted drafts, then the
    # model's own), packed int32; ``sampled_token_ids`` holds the first of them too.
    verified_token_ids: dict[int, bytes] = {}
    # Seconds the rank computed this step, not counting a wait for the previous pipeline stage.
    busy_seconds: float = 0.0
    # LoRA adapters this step's ``lora_loads`` could not put into their slots (their files went
    # missing or changed since the frontend checked them): ``lora_id`` -> why.
    lora_load_errors: dict[int, str] = {}
    # Speculative decoding with a draft model: the drafts it proposed after this step for each
    # decoding row (batch position), packed int32, for the row's next step.
    draft_token_ids: dict[int, bytes] = {}


# ---- process control ----------------------------------------------------------------------

UtilityResult = dict[str, int | float | str | bool | list[int] | dict[str, int] | None]


class UtilityRequest(msgspec.Struct, array_like=True, tag="call"):
    """A side call to the EngineCore: ``ping`` (health), ``debug_state`` (stats + invariants)
    or ``reset_prefix_cache``."""

    call_id: int
    method: str


class UtilityResponse(msgspec.Struct, array_like=True, tag="reply"):
    call_id: int
    result: UtilityResult | None = None
    error: str | None = None


class EngineReady(msgspec.Struct, array_like=True, tag="ready"):
    num_blocks: int
    vocab_size: int
    num_cpu_blocks: int = 0


class EngineDead(msgspec.Struct, array_like=True, tag="dead"):
    """The EngineCore's last word: why it is shutting down (in-flight requests already failed)."""

    reason: str


class WorkerReady(msgspec.Struct, array_like=True, tag="ready"):
    rank: int
    num_blocks: int
    vocab_size: int
    num_cpu_blocks: int = 0  # offload blocks this rank's CPU pool holds


class WorkerFailed(msgspec.Struct, array_like=True, tag="failed"):
    rank: int
    message: str


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


FrontendMessage = EngineCoreRequest | AbortRequests | UtilityRequest
CoreMessage = EngineCoreOutputs | UtilityResponse | EngineReady | EngineDead
ExecutorMessage = SchedulerOutput | GrammarBitmask | Shutdown
WorkerMessage = ModelRunnerOutput | WorkerReady | WorkerFailed
