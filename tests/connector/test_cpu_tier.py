"""The CPU tier's index: hits only when ready, no eviction of blocks a copy uses, no leaks."""

from strata.connector.cpu_tier import CPUTier
from strata.engine_core.kv_events import CPU_TIER, BlockRemoved, BlockStored


def keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def stored(tier: CPUTier, *names: str) -> list[int]:
    plan = tier.prepare_store(keys(*names))
    assert plan is not None
    tier.complete_store(plan.hashes)
    return plan.block_ids


def test_a_block_is_a_hit_only_once_its_store_completed():
    tier = CPUTier(4)
    plan = tier.prepare_store(keys("a", "b"))
    assert plan is not None and plan.hashes == keys("a", "b") and len(set(plan.block_ids)) == 2
    assert tier.lookup(keys("a", "b")) == 0 and tier.num_in_flight == 2
    tier.complete_store(plan.hashes)
    assert tier.lookup(keys("a", "b", "c")) == 2 and tier.num_in_flight == 0
    assert tier.take_events() == [BlockStored(keys("a", "b"), None, 32, CPU_TIER)]
    tier.check_invariants()


def test_lookup_counts_only_the_leading_run():
    tier = CPUTier(4)
    stored(tier, "a", "c")
    assert tier.lookup(keys("a", "b", "c")) == 1
    assert tier.lookup(keys("b", "c")) == 0


def test_store_skips_keys_already_present_or_in_flight():
    tier = CPUTier(4)
    stored(tier, "a")
    in_flight = tier.prepare_store(keys("b"))
    plan = tier.prepare_store(keys("a", "b", "c"))
    assert in_flight is not None and plan is not None
    assert plan.hashes == keys("c")
    assert tier.usage == 0.75


def test_a_full_tier_evicts_in_policy_order_but_never_pinned_or_in_flight_blocks():
    tier = CPUTier(4)
    stored(tier, "a", "b", "c")
    tier.prepare_store(keys("d"))  # in flight
    tier.prepare_load(keys("a"))  # pinned
    tier.take_events()
    plan = tier.prepare_store(keys("e"))
    assert plan is not None and plan.evicted == keys("b")
    assert tier.take_events() == [BlockRemoved(keys("b"), CPU_TIER)]
    assert tier.lookup(keys("b")) == 0 and tier.lookup(keys("a")) == 1
    tier.check_invariants()


def test_store_without_room_changes_nothing():
    tier = CPUTier(2)
    stored(tier, "a")
    tier.prepare_load(keys("a"))
    assert tier.prepare_store(keys("b", "c")) is None
    assert tier.usage == 0.5 and tier.lookup(keys("a")) == 1 and tier.take_events() == [BlockStored(keys("a"), None, 16, CPU_TIER)]
    tier.complete_load(keys("a"))
    plan = tier.prepare_store(keys("b", "c"))
    assert plan is not None and plan.evicted == keys("a")
    tier.check_invariants()


def test_a_failed_store_frees_its_blocks_and_is_no_hit():
    tier = CPUTier(2)
    plan = tier.prepare_store(keys("a", "b"))
    assert plan is not None
    tier.complete_store(plan.hashes, success=False)
    assert tier.lookup(keys("a")) == 0 and tier.usage == 0.0 and tier.take_events() == []
    tier.check_invariants()


def test_two_loads_pin_a_block_until_both_complete():
    tier = CPUTier(1)
    (block_id,) = stored(tier, "a")
    assert tier.prepare_load(keys("a")) == tier.prepare_load(keys("a")) == [block_id]
    tier.complete_load(keys("a"))
    assert tier.num_pinned == 1 and tier.prepare_store(keys("b")) is None
    tier.complete_load(keys("a"))
    assert tier.num_pinned == 0 and tier.prepare_store(keys("b")) is not None
    tier.check_invariants()


def test_arc_tier_protects_reused_blocks():
    tier = CPUTier(2, policy="arc")
    stored(tier, "a", "b")
    tier.touch(keys("a"))
    plan = tier.prepare_store(keys("c"))
    assert plan is not None and plan.evicted == keys("b")
