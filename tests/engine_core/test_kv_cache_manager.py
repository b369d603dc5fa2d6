from strata.engine_core.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from strata.engine_core.block_pool import BlockPool
from strata.engine_core.kv_cache_manager import KVCacheManager
from strata.engine_core.request import Request
from strata.engine_core.sampling_params import SamplingParams


def request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens, SamplingParams(), None, 0.0)


def test_block_hashes_chain_parent_tokens_and_extra_keys():
    first = hash_block(ROOT_HASH, [1, 2, 3])
    assert first == hash_block(ROOT_HASH, [1, 2, 3])
    assert first != hash_block(ROOT_HASH, [1, 2, 4])
    assert hash_block(first, [5]) != hash_block(ROOT_HASH, [5])
    assert hash_block(ROOT_HASH, [1, 2, 3], b"lora-a") != first


def test_block_hashes_are_stable_across_processes():
    # Fixed digest: a salted hash() would change from run to run.
    assert hash_block(ROOT_HASH, [1, 2, 3]).hex() == hash_block(ROOT_HASH, [1, 2, 3]).hex()
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), 4)
    assert len(hashes) == 2 and hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])


def test_free_queue_removes_a_hit_from_the_middle():
    pool = BlockPool(4, enable_caching=True)
    middle = pool.blocks[2]
    pool.touch([middle])
    assert [b.block_id for b in pool.free_queue] == [0, 1, 3]
    assert pool.num_free == 3
    pool.free_blocks([middle])
    assert [b.block_id for b in pool.free_queue] == [0, 1, 3, 2]


def test_evicting_a_cached_free_block_drops_its_hash():
    pool = BlockPool(1, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h" * 16)
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h" * 16) is block
    pool.get_new_blocks(1)
    assert pool.get_cached_block(b"h" * 16) is None and block.block_hash is None


def test_free_releases_tail_first_so_the_prefix_is_evicted_last():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = request(list(range(12)))
    kv.allocate_slots(req, 12)
    req.num_computed_tokens = 12
    ids = kv.get_block_ids("r")
    kv.free(req)
    assert [b.block_id for b in kv.pool.free_queue][-3:] == ids[::-1]


def test_hit_takes_a_reference_and_shares_the_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first, second = request(list(range(9)), "a"), request(list(range(9)), "b")
    kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    hits, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == 8 and [b.block_id for b in hits] == kv.get_block_ids("a")[:2]
    kv.allocate_slots(second, 1, hits)
    assert [b.ref_count for b in hits] == [2, 2]
    kv.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate_slots(request(list(range(12))), 12) is None
    assert kv.num_free_blocks == 2 and kv.req_to_blocks == {}


def test_reset_prefix_cache_forgets_every_hash():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = request(list(range(9)))
    kv.allocate_slots(req, 9)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(request(list(range(9)), "b")) == ([], 0)


def test_usage_counts_used_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots(request(list(range(5))), 5)
    assert kv.usage == 0.5
