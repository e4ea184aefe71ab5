"""The scheduler's table of which adapter holds which of the
``--max-loras-per-batch`` device slots. It decides; every rank's LoRA manager
fills its slots as told, so the ranks stay alike.

An adapter *in use* is one a running (or chunked) request needs: its slot is
never given to another adapter. A waiting request is admitted only if its
adapter is in use already or one more adapter fits beside those in use
(``fits``). Requests without an adapter need no slot.
"""

from __future__ import annotations

from collections.abc import Iterable


class LoRASlotTable:
    """Slot ``i`` holds adapter ``owners[i]`` (a uid) or nothing; when a batch
    needs an adapter that holds no slot, it takes a free one, else the least
    recently used one whose adapter is not in use."""

    def __init__(self, num_slots: int):
        self.owners: list[str | None] = [None] * num_slots
        self._last_use = [0] * num_slots
        self._clock = 0

    @property
    def num_slots(self) -> int:
        return len(self.owners)

    def fits(self, uid: str | None, in_use: set[str]) -> bool:
        """Whether a request of adapter ``uid`` can join requests whose
        adapters are ``in_use`` (a set without None)."""
        return uid is None or uid in in_use or len(in_use) < self.num_slots

    def assign(self, uids: list[str | None], in_use: Iterable[str]) -> list[int]:
        """The slot of each of a batch's requests (-1: no adapter), giving a
        slot to each adapter that has none. ``in_use``: the adapters whose
        slots must stay (the running requests'); the batch's own are added."""
        keep = set(in_use) | {u for u in uids if u is not None}
        if len(keep) > self.num_slots:
            raise RuntimeError(f"{len(keep)} LoRA adapters in use, {self.num_slots} slots: admission let too many in")
        self._clock += 1
        slot_of = {uid: i for i, uid in enumerate(self.owners) if uid is not None}
        for uid in dict.fromkeys(u for u in uids if u is not None):
            if uid not in slot_of:
                slot = self._victim(keep)
                if self.owners[slot] is not None:
                    del slot_of[self.owners[slot]]
                self.owners[slot] = uid
                slot_of[uid] = slot
            self._last_use[slot_of[uid]] = self._clock
        return [-1 if u is None else slot_of[u] for u in uids]

    def release(self, uid: str) -> None:
        """Empty the slot of ``uid`` (an unloaded adapter), if it holds one."""
        self.owners = [None if owner == uid else owner for owner in self.owners]

    def _victim(self, keep: set[str]) -> int:
        free = [i for i, uid in enumerate(self.owners) if uid is None]
        if free:
            return free[0]
        return min((i for i, uid in enumerate(self.owners) if uid not in keep), key=self._last_use.__getitem__)
