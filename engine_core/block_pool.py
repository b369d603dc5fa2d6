"""A fixed pool of KV-cache blocks with an LRU free queue and a prefix-hash index."""

from dataclasses import dataclass
from typing import Iterable

from strata.engine_core.kv_events import GPU_TIER, AllBlocksCleared, BlockRemoved, KVEvent


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One block of ``block_size`` token slots. ``block_hash`` is set once the block is full
    and registered for prefix caching; ``prev``/``next`` link it into the free queue."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    prev: "KVCacheBlock | None" = None
    next: "KVCacheBlock | None" = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front (least recently freed), append
    at the back, and remove from the middle in O(1) when a cached free block gets a hit."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free -= 1

    def pop_front(self) -> KVCacheBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next
        while block is not self._tail and block is not None:
            yield block
            block = block.next


class BlockPool:
    """Owns every block: hands out free ones (evicting their cached prefix), shares cached
    full blocks by hash, and takes blocks back when their last holder lets go. With
    ``record_events`` it lists evictions and resets in ``events`` for the KV-event stream."""

    def __init__(self, num_blocks: int, enable_caching: bool, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.record_events = record_events
        self.events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, count: int) -> list[KVCacheBlock]:
        if count > self.free_queue.num_free:
            raise ValueError(f"asked for {count} blocks, only {self.free_queue.num_free} free")
        blocks = []
        evicted: list[bytes] = []
        for _ in range(count):
            block = self.free_queue.pop_front()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            blocks.append(block)
        if evicted and self.record_events:
            self.events.append(BlockRemoved(evicted, GPU_TIER))
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given (first freed, first evicted)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a full block under its prefix hash; False if it was not registered
        because another block already holds that prefix (its twin keeps serving hits)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared(GPU_TIER))

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
