"""The CPU tier's index: which prefix-hash keys sit in which of a fixed number of CPU blocks.

A block is *in flight* from ``prepare_store`` until ``complete_store`` (its copy is being
written) and *ready* afterwards: only ready blocks are hits and can be loaded. Loads pin
ready blocks from ``prepare_load`` to ``complete_load``. Eviction, run by ``prepare_store``
when no block is free, takes only ready unpinned blocks, in the order of the eviction policy:
nothing is freed while a copy reads or writes it. This module moves no data; the worker side
copies, and the connector reports back here when the copies are done.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from strata.connector.policies import make_policy
from strata.engine_core.kv_events import CPU_TIER, BlockRemoved, BlockStored, KVEvent


@dataclass
class StorePlan:
    """``hashes[i]`` is to be copied into CPU block ``block_ids[i]``; ``evicted`` made room."""

    hashes: list[bytes]
    block_ids: list[int]
    evicted: list[bytes]


@dataclass(slots=True)
class _CPUBlock:
    block_id: int
    ready: bool = False
    pins: int = 0  # loads in flight that read it


class CPUTier:
    """Index over ``num_blocks`` CPU blocks of ``block_size`` tokens, keyed by the chained
    prefix hash of each block (that of the last GPU block inside it). Its KV events (the
    keys that became hits or were evicted) wait in ``take_events`` for the EngineCore."""

    def __init__(self, num_blocks: int, policy: str = "lru", block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"the CPU tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._policy = make_policy(policy, num_blocks)
        self._blocks: dict[bytes, _CPUBlock] = {}
        self._free_ids = list(range(num_blocks - 1, -1, -1))
        self._num_pinned = 0  # blocks with pins > 0; all of them are ready
        self._events: list[KVEvent] = []

    @property
    def usage(self) -> float:
        return len(self._blocks) / self.num_blocks

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_in_flight(self) -> int:
        return len(self._blocks) - len(self._policy)  # the policy holds exactly the ready ones

    def lookup(self, hashes: Iterable[bytes]) -> int | None:
        """How many leading ``hashes`` are ready hits. ``None`` would mean "not known yet, ask
        again" (a tier whose index is remote or being rebuilt); this one always knows."""
        hits = 0
        for block_hash in hashes:
            block = self._blocks.get(block_hash)
            if block is None or not block.ready:
                break
            hits += 1
        return hits

    def prepare_load(self, hashes: list[bytes]) -> list[int]:
        """Pin ready blocks for a load and return their CPU block ids."""
        block_ids = []
        for block_hash in hashes:
            block = self._blocks[block_hash]
            if not block.ready:
                raise ValueError("only ready blocks can be loaded")
            self._num_pinned += block.pins == 0
            block.pins += 1
            block_ids.append(block.block_id)
        return block_ids

    def complete_load(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            block = self._blocks[block_hash]
            block.pins -= 1
            self._num_pinned -= block.pins == 0

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Tell the policy these blocks were used again; absent or in-flight ones are skipped."""
        for block_hash in hashes:
            block = self._blocks.get(block_hash)
            if block is not None and block.ready:
                self._policy.touch(block_hash)

    def prepare_store(self, hashes: list[bytes]) -> StorePlan | None:
        """Reserve blocks for the ``hashes`` not in the tier yet (ready or in flight), evicting
        ready unpinned blocks if needed. None, with nothing changed, if that cannot make room."""
        new_hashes = [h for h in dict.fromkeys(hashes) if h not in self._blocks]
        shortfall = len(new_hashes) - len(self._free_ids)
        evicted: list[bytes] = []
        if shortfall > 0:
            if len(self._policy) - self._num_pinned < shortfall:
                return None
            evicted = self._policy.evict(shortfall, self._is_unpinned)
            for block_hash in evicted:
                self._free_ids.append(self._blocks.pop(block_hash).block_id)
            self._events.append(BlockRemoved(evicted, CPU_TIER))
        block_ids = []
        for block_hash in new_hashes:
            block = self._blocks[block_hash] = _CPUBlock(self._free_ids.pop())
            block_ids.append(block.block_id)
        return StorePlan(new_hashes, block_ids, evicted)

    def complete_store(self, hashes: list[bytes], success: bool = True, lora_id: int | None = None) -> None:
        """The copies into these blocks finished: they become hits, or are dropped on failure.
        ``lora_id``: the adapter load whose KV they hold (for the event)."""
        for block_hash in hashes:
            if success:
                self._blocks[block_hash].ready = True
                self._policy.insert(block_hash)
            else:
                self._free_ids.append(self._blocks.pop(block_hash).block_id)
        if success:
            # The tier does not know a key's parent: the keys of one store are consecutive
            # blocks of one request, but their parent may have been stored long ago.
            self._events.append(BlockStored(list(hashes), None, len(hashes) * self.block_size, CPU_TIER, lora_id))

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _is_unpinned(self, block_hash: bytes) -> bool:
        return self._blocks[block_hash].pins == 0

    def check_invariants(self) -> None:
        """Raise AssertionError unless free + used = total with distinct ids, the policy holds
        exactly the ready blocks, and only ready blocks are pinned (for tests)."""
        used_ids = [block.block_id for block in self._blocks.values()]
        if len(used_ids) + len(self._free_ids) != self.num_blocks:
            raise AssertionError("free + used != total")
        if len(set(used_ids) | set(self._free_ids)) != self.num_blocks:
            raise AssertionError("a CPU block id is used twice or lost")
        ready = [block for block in self._blocks.values() if block.ready]
        if len(ready) != len(self._policy):
            raise AssertionError("the eviction policy does not track exactly the ready blocks")
        pinned = [block for block in self._blocks.values() if block.pins]
        if any(not block.ready or block.pins < 0 for block in pinned):
            raise AssertionError("a block is pinned while in flight, or unpinned too often")
        if len(pinned) != self._num_pinned:
            raise AssertionError("the pinned-block count is off")
