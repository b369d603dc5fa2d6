"""Picks the replica for each request: round-robin, least-loaded, or cache-aware.

Cache-aware routing keeps, from every replica's KV events, which replicas hold which block
hashes (an LRU map of at most ``max_hashes`` entries), computes a request's block hashes
with the EngineCore's own function, and sends it to the replica holding the longest prefix
of them, unless that replica's load exceeds the least loaded one's by more than
``load_margin`` tokens; with no prefix anywhere it goes to the least loaded.

A routed request also pins its blocks to its replica until it finishes, whatever that
replica's events say meanwhile: requests sharing a prefix that arrive together land
together before any event is back, and a removal the replica published before it took the
request (its old copy of the prefix being evicted while the request waits in its queue)
does not send the next request with that prefix to another replica, which would then
compute and cache it a second time.

Load is tracked here, not read from the replicas' stats (which lag a step): for every
request routed and not yet finished, the prompt tokens its replica has to compute (those
past the prefix the router expects it to hold) plus the tokens generated so far. A request
whose system prompt is cached costs its replica little, so a replica serving the tenants
it caches does not look busy for holding their long prompts.
"""

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass

from strata.engine_core.block_hash import extend_block_hashes
from strata.engine_core.kv_events import CPU_TIER, GPU_TIER, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from strata.engine_core.protocol import LoRAAdapter

# Why a replica holds a hash: one bit each, ``_KINDS`` bits per replica in a hash's mask.
_BIT = {GPU_TIER: 0, CPU_TIER: 1}
_ROUTED_BIT = 2
_KINDS = 3


@dataclass
class _Routed:
    """A request in flight: where it went, the blocks it pins there, the load it adds."""

    replica: int
    block_hashes: list[bytes]
    load: int


class Router:
    def __init__(
        self, num_replicas: int, policy: str, block_size: int, load_margin: int = 2048, max_hashes: int = 1 << 20
    ) -> None:
        if policy not in ("cache-aware", "least-loaded", "round-robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.load_margin = load_margin
        self.max_hashes = max_hashes
        self.live = list(range(num_replicas))
        self.load = [0] * num_replicas
        # block hash -> bit mask, bit _KINDS * replica + kind: which replicas hold it, and why.
        self._holders: OrderedDict[bytes, int] = OrderedDict()
        self._requests: dict[str, _Routed] = {}
        self._pins: Counter[tuple[int, bytes]] = Counter()  # (replica, hash) -> requests pinning it
        self._turns = itertools.cycle(range(num_replicas))
        self._replica_bits = sum(1 << _KINDS * replica for replica in range(num_replicas))

    @property
    def num_hashes(self) -> int:
        return len(self._holders)

    def choose(self, block_hashes: list[bytes]) -> int:
        """The replica for a prompt with these block hashes (see ``block_hashes``; only
        cache-aware routing reads them). Does not record the choice: see ``routed``."""
        if not self.live:
            raise RuntimeError("no replica is serving")
        if self.policy == "round-robin":
            return next(replica for replica in self._turns if replica in self.live)
        least = min(self.live, key=self.load.__getitem__)
        if self.policy == "least-loaded":
            return least
        holders = self._longest_prefix_holders(block_hashes)
        if not holders:
            return least
        best = min(holders, key=self.load.__getitem__)
        return least if self.load[best] > self.load[least] + self.load_margin else best

    def block_hashes(
        self, token_ids: list[int], cache_salt: str | None = None, lora: LoRAAdapter | None = None
    ) -> list[bytes]:
        """The prompt's full-block hashes, as the EngineCore computes them ([] unless cache-aware):
        a request's adapter is in them, so a prefix routes to the replicas holding it for that
        adapter."""
        hashes: list[bytes] = []
        if self.policy == "cache-aware":
            extend_block_hashes(hashes, token_ids, self.block_size, salt=cache_salt, lora=lora)
        return hashes

    def routed(self, request_id: str, replica: int, block_hashes: list[bytes], num_tokens: int) -> None:
        """A prompt of ``num_tokens`` went to ``replica``: count the part it has to compute in
        the replica's load, and pin its blocks there until ``finished``."""
        cached_tokens = self._held_prefix_length(replica, block_hashes) * self.block_size
        load = max(num_tokens - cached_tokens, 1)
        self._requests[request_id] = _Routed(replica, block_hashes, load)
        self.load[replica] += load
        self._insert(block_hashes, replica, _ROUTED_BIT)
        self._pins.update((replica, block_hash) for block_hash in block_hashes)

    def generated(self, request_id: str) -> None:
        """The request produced a token (ignored if it is not in flight)."""
        request = self._requests.get(request_id)
        if request is not None:
            request.load += 1
            self.load[request.replica] += 1

    def finished(self, request_id: str) -> None:
        """The request ended (or was never sent): drop its load and its pins."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.load[request.replica] -= request.load
        unpinned = []
        for block_hash in request.block_hashes:
            key = (request.replica, block_hash)
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
                unpinned.append(block_hash)
        self._discard(unpinned, request.replica, _ROUTED_BIT)

    def apply(self, replica: int, events: list[KVEvent]) -> None:
        """Bring the map up to date with a batch of ``replica``'s KV events."""
        for event in events:
            if isinstance(event, BlockStored):
                self._insert(event.block_hashes, replica, _BIT[event.tier])
            elif isinstance(event, BlockRemoved):
                self._discard(event.block_hashes, replica, _BIT[event.tier])
            elif isinstance(event, AllBlocksCleared):
                self._clear(replica, _BIT[event.tier])

    def remove_replica(self, replica: int) -> None:
        """Take a dead replica out of routing and forget what it held and ran."""
        if replica not in self.live:
            return
        self.live.remove(replica)
        for request_id in [rid for rid, request in self._requests.items() if request.replica == replica]:
            self.finished(request_id)
        for kind in range(_KINDS):
            self._clear(replica, kind)

    def _longest_prefix_holders(self, hashes: list[bytes]) -> list[int]:
        """Live replicas that hold the longest run of leading ``hashes`` (for any reason)."""
        every_kind = (1 << _KINDS) - 1
        candidates = sum(every_kind << _KINDS * replica for replica in self.live)
        matched = 0
        for block_hash in hashes:
            held = self._holders.get(block_hash, 0) & candidates
            if not held:
                break
            self._holders.move_to_end(block_hash)
            # Keep every kind bit of each replica that holds this block for any reason.
            holding = (held | held >> 1 | held >> 2) & self._replica_bits
            candidates = holding * every_kind
            matched += 1
        if not matched:
            return []
        return [replica for replica in self.live if candidates >> _KINDS * replica & every_kind]

    def _held_prefix_length(self, replica: int, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` ``replica`` holds."""
        mask = ((1 << _KINDS) - 1) << _KINDS * replica
        held = 0
        for block_hash in hashes:
            if not self._holders.get(block_hash, 0) & mask:
                break
            held += 1
        return held

    def _insert(self, hashes: list[bytes], replica: int, kind: int) -> None:
        bit = 1 << _KINDS * replica + kind
        holders = self._holders
        for block_hash in hashes:
            holders[block_hash] = holders.get(block_hash, 0) | bit
            holders.move_to_end(block_hash)
        while len(holders) > self.max_hashes:
            holders.popitem(last=False)

    def _discard(self, hashes: list[bytes], replica: int, kind: int) -> None:
        bit = 1 << _KINDS * replica + kind
        holders = self._holders
        for block_hash in hashes:
            mask = holders.get(block_hash, 0) & ~bit
            if mask:
                holders[block_hash] = mask
            else:
                holders.pop(block_hash, None)

    def _clear(self, replica: int, kind: int) -> None:
        bit = 1 << _KINDS * replica + kind
        self._discard([h for h, mask in self._holders.items() if mask & bit], replica, kind)
