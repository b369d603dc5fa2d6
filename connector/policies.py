"""Eviction policies for the CPU tier: which ready block gives up its slot when the tier is full.

A policy sees only the tier's ready blocks, by key: ``insert`` when a store completes,
``touch`` when a block is used again, ``evict`` when the tier needs room. Blocks a copy still
uses stay in the policy's order but are passed over through ``can_evict``; the tier checks
beforehand that enough evictable blocks exist, so ``evict`` always finds ``count`` of them.
"""

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

EVICTION_POLICIES = ("lru", "arc")


class EvictionPolicy(Protocol):
    def __len__(self) -> int: ...

    def insert(self, key: bytes) -> None:
        """A block became ready (its store completed)."""

    def touch(self, key: bytes) -> None:
        """A ready block was used again."""

    def evict(self, count: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Forget and return ``count`` blocks that ``can_evict`` allows, in eviction order."""


class LRUPolicy:
    """Least recently inserted or touched goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, key: bytes) -> None:
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def evict(self, count: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        victims: list[bytes] = []
        for key in self._order:
            if len(victims) == count:
                break
            if can_evict(key):
                victims.append(key)
        for key in victims:
            del self._order[key]
        return victims


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over ``capacity`` blocks.

    T1 holds blocks used once, T2 blocks used again; B1 and B2 remember the keys recently
    evicted from each. ``target_t1`` (the paper's p) is how many of the resident blocks T1
    should hold: a store of a key found in B1 means T1 was too small and raises it, one found
    in B2 lowers it. Eviction takes from T1 while T1 is above its target, else from T2, so a
    scan of blocks used once cannot push out blocks that are used again.

    The tier evicts on demand (only when it has no free block), so the paper's REPLACE runs
    at eviction time with the target as it stands, and the ghost lists are trimmed at insertion
    to the paper's bounds: |T1| + |B1| <= capacity and all four lists <= 2 * capacity.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1 = 0
        self.t1: OrderedDict[bytes, None] = OrderedDict()  # each list: least recent first
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def insert(self, key: bytes) -> None:
        if key in self.b1:
            self.target_t1 = min(self.capacity, self.target_t1 + max(len(self.b2) // len(self.b1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.target_t1 = max(0, self.target_t1 - max(len(self.b1) // len(self.b2), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
            if len(self.t1) + len(self.b1) > self.capacity:
                self.b1.popitem(last=False)
        if len(self) + len(self.b1) + len(self.b2) > 2 * self.capacity:
            self.b2.popitem(last=False)

    def touch(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def evict(self, count: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        candidates = {
            True: (key for key in self.t1 if can_evict(key)),
            False: (key for key in self.t2 if can_evict(key)),
        }
        victims: list[tuple[bytes, bool]] = []  # (key, whether it was in T1)
        t1_size = len(self.t1)
        for _ in range(count):
            in_t1 = t1_size > self.target_t1
            key = next(candidates[in_t1], None)
            if key is None:  # the preferred list has nothing evictable left
                in_t1 = not in_t1
                key = next(candidates[in_t1])
            t1_size -= in_t1
            victims.append((key, in_t1))
        for key, in_t1 in victims:
            if in_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        return [key for key, _ in victims]


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, got {name!r}")
