"""The scheduler's view of the workers' LoRA slot pool: which adapter each slot holds, and
which slots running requests use.

A running request with an adapter holds a share of its adapter's slot until it finishes or is
preempted. A slot no running request holds is *idle*: it keeps its adapter (a request for it
takes the slot back without a reload) until an adapter without a slot needs it, and then the
idle slot unused the longest (never-filled slots first) changes hands. Every running request
holds a slot, so a step never has more adapters than slots.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

from strata.engine_core.protocol import LoRAAdapter, LoRASlotLoad


@dataclass
class LoRASlots:
    num_slots: int
    adapters: list[LoRAAdapter | None] = field(init=False)  # slot -> the adapter it holds
    _slot_of: dict[int, int] = field(init=False, default_factory=dict)  # lora_id -> slot
    _users: list[int] = field(init=False)  # slot -> running requests holding it
    _idle: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)  # LRU first

    def __post_init__(self) -> None:
        self.adapters = [None] * self.num_slots
        self._users = [0] * self.num_slots
        self._idle.update(dict.fromkeys(range(self.num_slots)))

    def has_slot(self, adapter: LoRAAdapter) -> bool:
        """Whether ``adapter`` already sits in a slot (a request for it joins that slot)."""
        return adapter.lora_id in self._slot_of

    def can_acquire(self, adapter: LoRAAdapter) -> bool:
        return adapter.lora_id in self._slot_of or bool(self._idle)

    def acquire(self, adapter: LoRAAdapter, loads: list[LoRASlotLoad]) -> int:
        """A share of ``adapter``'s slot for a request about to run; placing the adapter into a
        slot appends the load the workers must do first. The caller checked ``can_acquire``."""
        slot = self._slot_of.get(adapter.lora_id)
        if slot is None:
            slot, _ = self._idle.popitem(last=False)
            previous = self.adapters[slot]
            if previous is not None:
                del self._slot_of[previous.lora_id]
            self.adapters[slot] = adapter
            self._slot_of[adapter.lora_id] = slot
            loads.append(LoRASlotLoad(slot, adapter))
        elif self._users[slot] == 0:
            del self._idle[slot]
        self._users[slot] += 1
        return slot

    def forget(self, lora_id: int) -> None:
        """Empty the slot of an adapter the workers could not load (no running request holds
        it any more), so that the next adapter to need a slot takes it first."""
        slot = self._slot_of.pop(lora_id, None)
        if slot is None:
            return
        assert self._users[slot] == 0, "a failed adapter's slot is still held"
        self.adapters[slot] = None
        self._idle.move_to_end(slot, last=False)

    def release(self, slot: int) -> None:
        """A request holding ``slot`` stopped running."""
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None  # the most recently used idle slot

    def check_invariants(self, running_slots: list[int]) -> None:
        """Raise AssertionError unless the share counts match ``running_slots`` (the slots of
        the running requests with an adapter)."""
        users = [0] * self.num_slots
        for slot in running_slots:
            users[slot] += 1
        if users != self._users:
            raise AssertionError(f"slot users {self._users} but running requests hold {users}")
        if set(self._idle) != {slot for slot in range(self.num_slots) if users[slot] == 0}:
            raise AssertionError("the idle slots are not the slots no running request holds")
