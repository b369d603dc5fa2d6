"""The data-parallel router: cache-aware routing follows the longest prefix held, within
a load margin on the tokens each replica has to compute; a routed request pins its prefix to
its replica until it finishes; the hash map is bounded; dead replicas get nothing."""

import itertools

import pytest

from strata.engine_core.kv_events import CPU_TIER, GPU_TIER, AllBlocksCleared, BlockRemoved, BlockStored
from strata.engine_core.protocol import LoRAAdapter
from strata.runtime.data_parallel.router import Router

BLOCK = 4


def prompt(prefix: int, length: int = 16) -> list[int]:
    return [prefix] * length + [999]


def choose(router: Router, tokens: list[int]) -> int:
    return router.choose(router.block_hashes(tokens))


_request_ids = (f"request-{n}" for n in itertools.count())


def route(router: Router, replica: int, tokens: list[int]) -> str:
    request_id = next(_request_ids)
    router.routed(request_id, replica, router.block_hashes(tokens), len(tokens))
    return request_id


def removed_from(router: Router, replica: int, tokens: list[int]) -> None:
    router.apply(replica, [BlockRemoved(router.block_hashes(tokens), GPU_TIER)])


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
    route(router, 0, prompt(1))  # 17 tokens to compute on replica 0, and its blocks
    assert choose(router, prompt(1)) == 1
    route(router, 1, prompt(2)[:10])  # now 17 against 10: within the margin
    assert choose(router, prompt(1)) == 0


def test_load_counts_only_the_prompt_tokens_past_the_prefix_the_replica_holds():
    router = Router(2, "cache-aware", BLOCK, load_margin=10)
    stored_on(router, 0, prompt(1))
    for _ in range(3):  # 4 blocks held: each costs its replica the last token only
        route(router, 0, prompt(1))
    assert router.load == [3, 0]
    assert choose(router, prompt(1)) == 0


def test_generated_tokens_add_load_until_the_request_finishes():
    router = Router(2, "least-loaded", BLOCK)
    request_id = route(router, 0, prompt(1))
    router.generated(request_id)
    router.generated("never-routed")
    assert router.load == [18, 0]
    router.finished(request_id)
    assert router.load == [0, 0]


def test_requests_sharing_a_prefix_follow_the_first_before_any_event_arrives():
    router = Router(2, "cache-aware", BLOCK)
    first = choose(router, prompt(5))
    route(router, first, prompt(5))
    assert choose(router, prompt(5)[:12] + [7, 7, 7, 7]) == first


def test_a_removal_published_before_a_routing_does_not_unpin_the_routed_prefix():
    router = Router(2, "cache-aware", BLOCK)
    route(router, 0, prompt(2))
    stored_on(router, 0, prompt(1))
    first = route(router, 0, prompt(1))
    removed_from(router, 0, prompt(1))  # replica 0 evicted its old copy; the request will recompute it
    assert choose(router, prompt(1)) == 0
    router.finished(first)
    assert choose(router, prompt(1)) == 1  # nothing pins it any more: the least loaded


def test_a_prefix_stays_pinned_until_the_last_request_routed_with_it_finishes():
    router = Router(2, "cache-aware", BLOCK)
    first, second = route(router, 0, prompt(1)), route(router, 0, prompt(1))
    router.finished(first)
    router.generated(second)
    assert choose(router, prompt(1)) == 0
    router.finished(second)
    assert router.num_hashes == 0


def test_removed_and_cleared_blocks_stop_attracting_requests():
    router = Router(2, "cache-aware", BLOCK)
    route(router, 0, prompt(3))
    stored_on(router, 0, prompt(1))
    router.apply(0, [BlockRemoved(router.block_hashes(prompt(1))[:1], GPU_TIER)])
    assert choose(router, prompt(1)) == 1
    stored_on(router, 0, prompt(2))
    router.apply(0, [AllBlocksCleared(GPU_TIER)])
    assert choose(router, prompt(2)) == 1


def test_the_hash_map_keeps_only_the_most_recent_hashes():
    router = Router(2, "cache-aware", BLOCK, max_hashes=8)
    for prefix in range(10):
        stored_on(router, 0, prompt(prefix))
    assert router.num_hashes == 8
    route(router, 0, [0])
    assert choose(router, prompt(0)) == 1  # forgotten: least loaded
    assert choose(router, prompt(9)) == 0


def test_a_removed_replica_gets_no_requests_under_any_policy():
    for policy in ("cache-aware", "least-loaded", "round-robin"):
        router = Router(3, policy, BLOCK)
        stored_on(router, 1, prompt(1))
        route(router, 1, prompt(2))
        router.remove_replica(1)
        assert {choose(router, prompt(1)) for _ in range(6)} <= {0, 2}
        assert router.load == [0, 0, 0]


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


def test_a_prompt_routes_by_its_adapter_and_prefix():
    router = Router(3, "cache-aware", BLOCK)
    adapter_a, adapter_b = LoRAAdapter("a", 1, "/a"), LoRAAdapter("b", 2, "/b")
    router.routed("with-a", 1, router.block_hashes(prompt(1), lora=adapter_a), len(prompt(1)))
    router.routed("with-b", 2, router.block_hashes(prompt(1), lora=adapter_b), len(prompt(1)))
    assert router.choose(router.block_hashes(prompt(1), lora=adapter_a)) == 1
    assert router.choose(router.block_hashes(prompt(1), lora=adapter_b)) == 2
    assert choose(router, prompt(1)) == 0  # the base model holds it nowhere: the least loaded
