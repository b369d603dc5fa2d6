"""The data-parallel router: cache-aware routing follows the longest prefix held, within
a load margin; its hash map is bounded; dead replicas get nothing."""

import pytest

from strata.engine_core.kv_events import CPU_TIER, GPU_TIER, AllBlocksCleared, BlockRemoved, BlockStored
from strata.launch.data_parallel.router import Router

BLOCK = 4


def prompt(prefix: int, length: int = 16) -> list[int]:
    return [prefix] * length + [999]


def choose(router: Router, tokens: list[int]) -> int:
    return router.choose(router.block_hashes(tokens))


def route(router: Router, replica: int, tokens: list[int]) -> None:
    router.routed(replica, router.block_hashes(tokens), len(tokens))


def stored_on(router: Router, replica: int, tokens: list[int], tier: str = GPU_TIER) -> None:
    router.apply(replica, [BlockStored(router.block_hashes(tokens), None, len(tokens), tier)])


def test_cache_aware_picks_the_replica_with_the_longest_prefix():
    router = Router(3, "cache-aware", BLOCK)
    stored_on(router, 0, prompt(1)[:8])
    stored_on(router, 2, prompt(1)[:16])
    assert choose(router, prompt(1)) == 2


def test_a_prefix_held_only_in_the_cpu_tier_counts():
    router = Router(2, "cache-aware", BLOCK)
    stored_on(router, 1, prompt(1)[:16], CPU_TIER)
    assert choose(router, prompt(1)) == 1


def test_without_a_prefix_hit_the_least_loaded_replica_wins():
    router = Router(2, "cache-aware", BLOCK)
    route(router, 0, prompt(1))
    assert choose(router, prompt(2)) == 1


def test_a_holder_loaded_beyond_the_margin_loses_to_the_least_loaded():
    router = Router(2, "cache-aware", BLOCK, load_margin=10)
    route(router, 0, prompt(1))  # 17 tokens on replica 0, and its blocks
    assert choose(router, prompt(1)) == 1
    router.add_load(1, 10)  # now 17 against 10: within the margin
    assert choose(router, prompt(1)) == 0


def test_requests_sharing_a_prefix_follow_the_first_before_any_event_arrives():
    router = Router(2, "cache-aware", BLOCK)
    first = choose(router, prompt(5))
    route(router, first, prompt(5))
    assert choose(router, prompt(5)[:12] + [7, 7, 7, 7]) == first


def test_removed_and_cleared_blocks_stop_attracting_requests():
    router = Router(2, "cache-aware", BLOCK)
    router.add_load(0, 5)
    stored_on(router, 0, prompt(1))
    router.apply(0, [BlockRemoved(router.block_hashes(prompt(1))[:1], GPU_TIER)])
    assert choose(router, prompt(1)) == 1
    stored_on(router, 0, prompt(2))
    router.apply(0, [AllBlocksCleared(GPU_TIER)])
    assert choose(router, prompt(2)) == 1 and router.num_hashes == 0


def test_the_hash_map_keeps_only_the_most_recent_hashes():
    router = Router(2, "cache-aware", BLOCK, max_hashes=8)
    for prefix in range(10):
        stored_on(router, 0, prompt(prefix))
    assert router.num_hashes == 8
    router.add_load(0, 1)
    assert choose(router, prompt(0)) == 1  # forgotten: least loaded
    assert choose(router, prompt(9)) == 0


def test_a_removed_replica_gets_no_requests_under_any_policy():
    for policy in ("cache-aware", "least-loaded", "round-robin"):
        router = Router(3, policy, BLOCK)
        stored_on(router, 1, prompt(1))
        router.remove_replica(1)
        assert {choose(router, prompt(1)) for _ in range(6)} <= {0, 2}


def test_round_robin_takes_turns():
    router = Router(3, "round-robin", BLOCK)
    assert [choose(router, prompt(1)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_no_live_replica_is_an_error():
    router = Router(1, "least-loaded", BLOCK)
    router.remove_replica(0)
    with pytest.raises(RuntimeError, match="no replica"):
        choose(router, prompt(1))


def test_a_salted_prompt_is_not_routed_by_the_unsalted_copy_of_its_prefix():
    router = Router(2, "cache-aware", BLOCK)
    route(router, 1, prompt(1))
    assert choose(router, prompt(1)) == 1
    assert router.choose(router.block_hashes(prompt(1), cache_salt="tenant-a")) == 0  # the least loaded
