"""Scheduler side of the CPU offloading connector: decides which KV blocks move between the
GPU cache and the CPU tier each step, and keeps blocks alive while their copies run.

Granularity. One CPU (offload) block holds ``factor`` consecutive GPU blocks of a request;
its key in the tier is the prefix hash of the last of them (hashes chain, so it names the
whole prefix). In a ``BlockTransfer`` both id lists are in GPU-block granularity and pair
up index by index: CPU offload block ``b`` is split into the sub-blocks ``b * factor + i``
for ``i`` in ``range(factor)``, and sub-block ``i`` holds the request's GPU block ``i`` of
the group. The worker's CPU pool therefore has ``num_cpu_blocks * factor`` GPU-sized blocks.

Timing. The KV of the tokens scheduled in a step is written by that step's forward, so a
block is stored by the *next* step's metadata, once every token in it was computed in an
earlier step; the worker runs a step's copies after the previous step's forward. A request
that finishes or is preempted gets its remaining computed blocks stored then (the last
step's blocks would be lost otherwise), and its GPU blocks stay held until those copies end.
Stores are planned for the requests scheduled in a step (and at finish or preemption), so
the per-step cost follows the batch, not the number of blocks.

Loads. A new request whose prefix continues, past its local GPU hit, into ready CPU blocks
loads them asynchronously and waits (``WAITING_FOR_KV``). A block being loaded for one
request is never loaded again for another: the second request is told "not known yet" and
asks again next step, when the first request's blocks serve it from the GPU prefix cache.
"""

import itertools
from dataclasses import dataclass

from strata.connector.cpu_tier import CPUTier
from strata.engine_core.block_hash import extend_block_hashes
from strata.engine_core.kv_connector import SchedulerConnector
from strata.engine_core.kv_events import KVEvent
from strata.engine_core.protocol import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    SchedulerOutput,
    unpack_handles,
)
from strata.engine_core.request import Request


@dataclass
class OffloadStats:
    queried_tokens: int = 0  # tokens past the local GPU hit, over admitted requests
    hit_tokens: int = 0  # of those, tokens found in the CPU tier
    blocks_stored: int = 0  # offload blocks whose store completed
    blocks_loaded: int = 0  # offload blocks whose load completed
    bytes_moved: int = 0  # by the workers, all ranks together
    transfer_seconds: float = 0.0


@dataclass(eq=False)
class _RequestState:
    """One admission of a request: its GPU block table and the copies that use it. After
    the request finishes or is preempted, the state lives on (under ``hold_key``) only
    until those copies end."""

    request: Request
    block_ids: list[int]
    next_store_at: int  # computed tokens at which offload block ``num_offloaded`` is full
    num_offloaded: int = 0  # leading offload blocks already stored, in flight or skipped
    loading: bool = False
    in_flight: int = 0  # transfers reading or writing ``block_ids``
    hold_key: str | None = None


@dataclass(eq=False)
class _Transfer:
    owner: _RequestState
    hashes: list[bytes]  # the tier keys it reads or writes


@dataclass
class _Match:
    """What the last lookup found, for the allocation that follows it."""

    request_id: str
    num_local_tokens: int
    num_blocks: int  # offload blocks to load after the local hit


class OffloadingConnectorScheduler(SchedulerConnector):
    """The ``SchedulerConnector`` that offloads full KV blocks to a CPU tier of
    ``num_cpu_blocks`` blocks of ``offload_block_size`` tokens each, evicted by ``policy``."""

    def __init__(
        self, block_size: int, offload_block_size: int, num_cpu_blocks: int, policy: str = "lru"
    ) -> None:
        if block_size < 1 or offload_block_size < 1 or offload_block_size % block_size:
            raise ValueError(
                f"offload_block_size ({offload_block_size}) must be a positive multiple of "
                f"block_size ({block_size})"
            )
        self.block_size = block_size
        self.offload_block_size = offload_block_size
        self.factor = offload_block_size // block_size
        self.tier = CPUTier(num_cpu_blocks, policy, offload_block_size)
        self.stats = OffloadStats()
        self._requests: dict[str, _RequestState] = {}  # admitted and not finished or preempted
        self._by_handle: dict[int, _RequestState] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._loading: set[bytes] = set()  # keys with a load in flight
        self._match: _Match | None = None
        self._loads: list[BlockTransfer] = []  # planned since the last build_connector_meta
        self._stores: list[BlockTransfer] = []
        self._ids = itertools.count()

    # ---- admission -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens of whole ready CPU blocks that continue the local hit, short of the last
        token (it must be computed for its logits). Nothing if the local hit ends inside an
        offload block; ``None`` if the tier cannot say yet or another request is loading them."""
        self._match = None
        num_hits = 0
        if num_computed_tokens % self.offload_block_size == 0:
            first = num_computed_tokens // self.offload_block_size
            keys = self._keys(request, first, (request.num_tokens - 1) // self.offload_block_size)
            found = self.tier.lookup(keys)
            if found is None or not self._loading.isdisjoint(keys[:found]):
                return None, False
            num_hits = found
        self._match = _Match(request.request_id, num_computed_tokens, num_hits)
        return num_hits * self.offload_block_size, num_hits > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Record the block table; on a first admission, touch the prefix in the tier and,
        if the lookup found CPU blocks, plan their load into the GPU blocks after the hit."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(request, list(block_ids), next_store_at=self.offload_block_size)
            self._requests[request.request_id] = state
        else:  # the load landed and the request now gets the rest of its blocks
            state.block_ids = list(block_ids)
        match, self._match = self._match, None
        if match is None or match.request_id != request.request_id:
            return
        self.stats.queried_tokens += request.num_tokens - match.num_local_tokens
        self.stats.hit_tokens += num_external_tokens
        first = match.num_local_tokens // self.offload_block_size
        self.tier.touch(self._keys(request, 0, first + match.num_blocks))
        if num_external_tokens == 0:
            return
        keys = self._keys(request, first, first + match.num_blocks)
        cpu_ids = self.tier.prepare_load(keys)
        gpu_ids = block_ids[first * self.factor : (first + match.num_blocks) * self.factor]
        self._loading.update(keys)
        state.loading = True
        self._loads.append(self._start_transfer(state, keys, gpu_ids, cpu_ids))

    # ---- each step -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """This step's loads, and stores of the offload blocks that earlier steps filled."""
        for handle in scheduler_output.finished_handles + scheduler_output.preempted_handles:
            self._by_handle.pop(handle, None)  # before new requests: a handle may be reused
        for new in scheduler_output.new_requests:
            # Stored from its next step on: its prefix hit may include blocks that another
            # request computes in this very step.
            self._by_handle[new.handle] = self._requests[new.request_id]
        cached = scheduler_output.cached
        for handle in unpack_handles(cached.handles):
            state = self._by_handle[handle]
            new_block_ids = cached.new_block_ids.get(handle)
            if new_block_ids:
                state.block_ids += new_block_ids
            computed_before = state.request.num_computed_tokens - cached.num_tokens.get(handle, 1)
            if computed_before >= state.next_store_at:
                self._store_full_blocks(state, computed_before)
        if not self._loads and not self._stores:
            return None
        meta = KVConnectorMetadata(loads=self._loads, stores=self._stores)
        self._loads, self._stores = [], []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> tuple[list[str], list[str]]:
        loaded: list[str] = []
        released: list[str] = []
        self.stats.bytes_moved += output.bytes_moved
        self.stats.transfer_seconds += output.transfer_seconds
        for transfer_id in output.finished_recving:
            transfer = self._transfers.pop(transfer_id)
            self.tier.complete_load(transfer.hashes)
            self._loading.difference_update(transfer.hashes)
            self.stats.blocks_loaded += len(transfer.hashes)
            transfer.owner.loading = False
            if transfer.owner.hold_key is None:  # not aborted meanwhile
                loaded.append(transfer.owner.request.request_id)
            self._end_transfer(transfer.owner, released)
        for transfer_id in output.finished_sending:
            transfer = self._transfers.pop(transfer_id)
            lora = transfer.owner.request.lora
            self.tier.complete_store(transfer.hashes, lora_id=None if lora is None else lora.lora_id)
            self.stats.blocks_stored += len(transfer.hashes)
            self._end_transfer(transfer.owner, released)
        return loaded, released

    # ---- requests leaving their blocks ------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> str | None:
        return self._release(request)

    def request_preempted(self, request: Request, block_ids: list[int]) -> str | None:
        return self._release(request)

    def _release(self, request: Request) -> str | None:
        """Store the request's computed blocks not in the tier yet, and hold its GPU blocks
        while any copy uses them. A request still loading has nothing new to store."""
        state = self._requests.pop(request.request_id, None)
        if state is None:  # never admitted
            return None
        if not state.loading:
            self._store_full_blocks(state, request.num_computed_tokens)
        if state.in_flight == 0:
            return None
        state.hold_key = f"cpu-offload-hold-{next(self._ids)}"
        return state.hold_key

    def scheduler_stats(self) -> dict[str, int | float]:
        return {
            "offload_queried_tokens": self.stats.queried_tokens,
            "offload_hit_tokens": self.stats.hit_tokens,
            "offload_blocks_stored": self.stats.blocks_stored,
            "offload_blocks_loaded": self.stats.blocks_loaded,
            "offload_bytes_moved": self.stats.bytes_moved,
            "offload_transfer_seconds": self.stats.transfer_seconds,
            "offload_cpu_usage": self.tier.usage,
        }

    def take_events(self) -> list[KVEvent]:
        return self.tier.take_events()

    # ---- helpers -------------------------------------------------------------------------

    def _keys(self, request: Request, first: int, end: int) -> list[bytes]:
        """Tier keys of the request's offload blocks ``first`` .. ``end - 1`` (all full)."""
        hashes = request.block_hashes
        if len(hashes) < end * self.factor:
            extend_block_hashes(
                hashes, request.all_token_ids, self.block_size, salt=request.cache_salt, lora=request.lora
            )
        return hashes[(first + 1) * self.factor - 1 : end * self.factor : self.factor]

    def _store_full_blocks(self, state: _RequestState, num_computed: int) -> None:
        """Plan stores of the offload blocks that ``num_computed`` tokens fill, past those
        already handled. Blocks the tier already has are skipped; if the tier cannot make
        room they are skipped too (a later hit simply stops short of them)."""
        first, end = state.num_offloaded, num_computed // self.offload_block_size
        if end <= first:
            return
        state.num_offloaded = end
        state.next_store_at = (end + 1) * self.offload_block_size
        keys = self._keys(state.request, first, end)
        plan = self.tier.prepare_store(keys)
        if plan is None or not plan.hashes:
            return
        index = {key: first + i for i, key in enumerate(keys)}
        gpu_ids = [
            state.block_ids[index[key] * self.factor + i] for key in plan.hashes for i in range(self.factor)
        ]
        self._stores.append(self._start_transfer(state, plan.hashes, gpu_ids, plan.block_ids))

    def _start_transfer(
        self, owner: _RequestState, hashes: list[bytes], gpu_ids: list[int], cpu_ids: list[int]
    ) -> BlockTransfer:
        transfer_id = str(next(self._ids))
        self._transfers[transfer_id] = _Transfer(owner, hashes)
        owner.in_flight += 1
        cpu_sub_ids = [cpu_id * self.factor + i for cpu_id in cpu_ids for i in range(self.factor)]
        return BlockTransfer(transfer_id, gpu_ids, cpu_sub_ids)

    def _end_transfer(self, owner: _RequestState, released: list[str]) -> None:
        owner.in_flight -= 1
        if owner.in_flight == 0 and owner.hold_key is not None:
            released.append(owner.hold_key)
