"""Maps requests to KV-cache blocks: prefix-cache lookups, slot allocation, freeing."""

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from strata.engine_core.block_hash import extend_block_hashes
from strata.engine_core.block_pool import BlockPool, KVCacheBlock
from strata.engine_core.kv_events import GPU_TIER, BlockStored
from strata.engine_core.request import Request


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's lookup: once, when it is first admitted (not on retries)."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Each request's block table (a list of blocks, in token order) over one ``BlockPool``."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, record_events: bool = False
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.held: dict[str, list[KVCacheBlock]] = {}  # blocks a connector copy still uses
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def num_releasable_blocks(self) -> int:
        """Blocks that releasing every hold would free (held, and used by nothing else)."""
        return sum(1 for table in self.held.values() for block in table if block.ref_count == 1)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request, and its token
        count. The last token is never a hit: it must be computed to produce logits. Not
        counted in ``prefix_stats``: the caller records the lookup that admits a request."""
        if not self.enable_caching:
            return [], 0
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, salt=request.cache_salt, lora=request.lora
        )
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_external_tokens: int = 0,
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (the local
        prefix hit ``new_computed_blocks`` and ``num_external_tokens`` loaded by a connector
        come first). Returns the newly allocated blocks, or None if the pool cannot supply
        them, in which case nothing changed. ``delay_caching`` keeps blocks still being
        loaded out of the prefix index until ``cache_blocks`` is called."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = []
        num_computed = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_external_tokens
        )
        num_filled = num_computed + num_new_tokens
        num_new_blocks = -(-num_filled // self.block_size) - len(blocks) - len(new_computed_blocks)
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0 or new_computed_blocks:
            # Hits sitting in the free queue stop being free once taken.
            free_hits = sum(1 for block in new_computed_blocks if block.ref_count == 0)
            if num_new_blocks > self.pool.num_free - free_hits:
                return None
            if request.request_id not in self.req_to_blocks:
                self.req_to_blocks[request.request_id] = blocks
                self._num_cached_blocks[request.request_id] = 0
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            if num_new_blocks > 0:
                new_blocks = self.pool.get_new_blocks(num_new_blocks)
                blocks.extend(new_blocks)
        if num_filled >= self.block_size and not delay_caching:
            self.cache_blocks(request, num_filled)
        # Until its table is full the request needs nothing from us. A block that fills up
        # meanwhile is registered for prefix caching at the next allocation or at free().
        request.kv_fast_limit = len(blocks) * self.block_size
        return new_blocks

    def cache_blocks(self, request: Request, num_filled: int) -> None:
        """Register the request's blocks that ``num_filled`` tokens fill for prefix caching."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_filled, request.num_tokens) // self.block_size
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        hashes = request.block_hashes
        extend_block_hashes(
            hashes, request.all_token_ids, self.block_size, salt=request.cache_salt, lora=request.lora
        )
        run_start = None  # the first index of the current run of newly registered blocks
        for index in range(num_cached, num_full):
            if self.pool.cache_block(blocks[index], hashes[index]):
                run_start = index if run_start is None else run_start
            elif run_start is not None:
                self._stored(request, run_start, index)
                run_start = None
        if run_start is not None:
            self._stored(request, run_start, num_full)
        self._num_cached_blocks[request.request_id] = num_full

    def _stored(self, request: Request, start: int, end: int) -> None:
        if self.pool.record_events:
            hashes = request.block_hashes
            parent = hashes[start - 1] if start else None
            lora_id = None if request.lora is None else request.lora.lora_id
            event = BlockStored(hashes[start:end], parent, (end - start) * self.block_size, GPU_TIER, lora_id)
            self.pool.events.append(event)

    def free_tail(self, request: Request, num_tokens: int) -> int | None:
        """Give back the request's blocks past the ones its first ``num_tokens`` tokens use
        (slots that rejected drafts took: never full of real tokens, so never cached). Returns
        the blocks kept if any were given back (the workers' tables must be cut too), else None."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return None
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))
        request.kv_fast_limit = keep * self.block_size
        return keep

    def free(self, request: Request) -> None:
        """Release a request's blocks tail-first, so its prefix stays cached the longest."""
        self.pool.free_blocks(reversed(self._detach(request)))

    def hold(self, request: Request, key: str) -> None:
        """Detach a request's blocks without freeing them: they stay allocated under ``key``
        until ``release(key)``, and the request may allocate afresh meanwhile."""
        self.held[key] = self._detach(request)

    def release(self, key: str) -> None:
        self.pool.free_blocks(reversed(self.held.pop(key, [])))

    def _detach(self, request: Request) -> list[KVCacheBlock]:
        """Take a request's block table away, registering its full blocks for prefix caching."""
        if request.request_id in self.req_to_blocks and request.num_computed_tokens >= self.block_size:
            self.cache_blocks(request, request.num_computed_tokens)
        self._num_cached_blocks.pop(request.request_id, None)
        request.kv_fast_limit = 0
        return self.req_to_blocks.pop(request.request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        for request_id in self._num_cached_blocks:
            self._num_cached_blocks[request_id] = 0

    def check_invariants(self) -> None:
        """Raise AssertionError unless ref counts equal the block tables holding each block,
        free blocks have ref count 0, free + used = total, and the hash index is consistent."""
        tables = [*self.req_to_blocks.values(), *self.held.values()]
        holders = Counter(block.block_id for table in tables for block in table)
        free_ids = [block.block_id for block in self.pool.free_queue]
        if len(free_ids) != self.pool.num_free or len(set(free_ids)) != len(free_ids):
            raise AssertionError("free queue length or membership is inconsistent")
        free_set = set(free_ids)
        for block in self.pool.blocks:
            if block.ref_count != holders[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref count {block.ref_count} but held by "
                    f"{holders[block.block_id]} block tables"
                )
            if (block.ref_count == 0) != (block.block_id in free_set):
                raise AssertionError(f"block {block.block_id}: free iff ref count is 0 violated")
        used = sum(1 for block in self.pool.blocks if block.ref_count > 0)
        if used + self.pool.num_free != self.pool.num_blocks:
            raise AssertionError("free + used != total")
        for block_hash, block in self.pool.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"hash index points at block {block.block_id} with another hash")
