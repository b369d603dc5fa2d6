"""Eviction order of the CPU tier's policies on small traces."""

import pytest

from strata.connector.policies import ARCPolicy, LRUPolicy, make_policy


def run_trace(policy, capacity: int, trace: str) -> list[str]:
    """Replay "+X" (store X, evicting one block first when full) and "*X" (use X again);
    return the evicted keys in order."""
    evicted = []
    for op in trace.split():
        key = op[1:].encode()
        if op[0] == "+":
            if len(policy) == capacity:
                evicted += [k.decode() for k in policy.evict(1, lambda k: True)]
            policy.insert(key)
        else:
            policy.touch(key)
    return evicted


def test_lru_evicts_the_least_recently_stored_or_used():
    assert run_trace(LRUPolicy(), 3, "+A +B +C *A +D +E") == ["B", "C"]


def test_arc_keeps_a_reused_block_through_a_scan_that_makes_lru_drop_it():
    trace = "+A *A +B +C +D +E +F"
    assert run_trace(LRUPolicy(), 3, trace) == ["A", "B", "C"]
    assert run_trace(ARCPolicy(3), 3, trace) == ["B", "C", "D"]


def test_arc_ghost_hits_move_the_target_size_of_t1():
    arc = ARCPolicy(2)
    # B leaves T1 and comes back: T1 was too small, so its target grows and T2 gives up A.
    assert run_trace(arc, 2, "+A *A +B +C +B +D") == ["B", "C", "A"]
    assert arc.target_t1 == 1
    # A leaves T2 and comes back: now T2 was too small, so the target shrinks again.
    assert run_trace(arc, 2, "+A +E") == ["B", "D"]
    assert arc.target_t1 == 0


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_eviction_passes_over_blocks_a_copy_uses(name):
    policy = make_policy(name, 3)
    for key in (b"A", b"B", b"C"):
        policy.insert(key)
    assert policy.evict(2, lambda key: key != b"A") == [b"B", b"C"]
    assert len(policy) == 1


def test_arc_takes_from_t2_when_t1_has_nothing_evictable():
    arc = ARCPolicy(2)
    run_trace(arc, 2, "+A *A +B")  # T1 = [B], T2 = [A], and T1 is above its target
    assert arc.evict(1, lambda key: key != b"B") == [b"A"]


def test_unknown_policy_name_is_rejected():
    with pytest.raises(ValueError, match="eviction policy must be one of lru, arc, got 'fifo'"):
        make_policy("fifo", 4)
