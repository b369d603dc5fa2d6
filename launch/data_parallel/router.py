"""Picks the replica for each request: round-robin, least-loaded, or cache-aware.

Cache-aware routing keeps, from every replica's KV events, which replicas hold which block
hashes (an LRU map of at most ``max_hashes`` entries), computes a request's block hashes
with the EngineCore's own function, and sends it to the replica holding the longest prefix
of them, unless that replica's load exceeds the least loaded one's by more than
``load_margin`` tokens; with no prefix anywhere it goes to the least loaded. A request is
also recorded as held by the replica it was sent to, before that replica's events say so:
requests sharing a prefix that arrive together then land together.

Load is tracked here, not read from the replicas' stats (which lag a step): the prompt
tokens plus the tokens generated so far of every request routed and not yet finished.
"""

import itertools
from collections import OrderedDict

from strata.engine_core.block_hash import extend_block_hashes
from strata.engine_core.kv_events import GPU_TIER, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_TIERS = {GPU_TIER: 0, "cpu": 1}


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
        # block hash -> bit mask, bit 2 * replica + tier: which replicas hold it, in which tier.
        self._holders: OrderedDict[bytes, int] = OrderedDict()
        self._turns = itertools.cycle(range(num_replicas))
        self._gpu_bits = sum(1 << 2 * replica for replica in range(num_replicas))

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

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[bytes]:
        """The prompt's full-block hashes, as the EngineCore computes them ([] unless cache-aware)."""
        hashes: list[bytes] = []
        if self.policy == "cache-aware":
            extend_block_hashes(hashes, token_ids, self.block_size, salt=cache_salt)
        return hashes

    def routed(self, replica: int, block_hashes: list[bytes], num_tokens: int) -> None:
        """A prompt of ``num_tokens`` went to ``replica``: count its load, expect its blocks there."""
        self.load[replica] += num_tokens
        self._insert(block_hashes, replica, GPU_TIER)

    def add_load(self, replica: int, num_tokens: int) -> None:
        """Tokens generated (positive) or a finished request's tokens (negative) on ``replica``."""
        self.load[replica] += num_tokens

    def apply(self, replica: int, events: list[KVEvent]) -> None:
        """Bring the map up to date with a batch of ``replica``'s KV events."""
        for event in events:
            if isinstance(event, BlockStored):
                self._insert(event.block_hashes, replica, event.tier)
            elif isinstance(event, BlockRemoved):
                self._discard(event.block_hashes, replica, event.tier)
            elif isinstance(event, AllBlocksCleared):
                self._clear(replica, event.tier)

    def remove_replica(self, replica: int) -> None:
        """Take a dead replica out of routing and forget what it held."""
        if replica in self.live:
            self.live.remove(replica)
            for tier in _TIERS:
                self._clear(replica, tier)

    def _longest_prefix_holders(self, hashes: list[bytes]) -> list[int]:
        """Live replicas that hold the longest run of leading ``hashes`` (in any tier)."""
        candidates = sum(3 << 2 * replica for replica in self.live)
        matched = 0
        for block_hash in hashes:
            held = self._holders.get(block_hash, 0) & candidates
            if not held:
                break
            self._holders.move_to_end(block_hash)
            # Keep both tier bits of every replica that holds this block in either tier.
            holding = (held | held >> 1) & self._gpu_bits
            candidates = holding | holding << 1
            matched += 1
        if not matched:
            return []
        return [replica for replica in self.live if candidates >> 2 * replica & 3]

    def _insert(self, hashes: list[bytes], replica: int, tier: str) -> None:
        bit = 1 << 2 * replica + _TIERS[tier]
        holders = self._holders
        for block_hash in hashes:
            holders[block_hash] = holders.get(block_hash, 0) | bit
            holders.move_to_end(block_hash)
        while len(holders) > self.max_hashes:
            holders.popitem(last=False)

    def _discard(self, hashes: list[bytes], replica: int, tier: str) -> None:
        bit = 1 << 2 * replica + _TIERS[tier]
        holders = self._holders
        for block_hash in hashes:
            mask = holders.get(block_hash, 0) & ~bit
            if mask:
                holders[block_hash] = mask
            else:
                holders.pop(block_hash, None)

    def _clear(self, replica: int, tier: str) -> None:
        bit = 1 << 2 * replica + _TIERS[tier]
        for block_hash in [h for h, mask in self._holders.items() if mask & bit]:
            self._discard([block_hash], replica, tier)
