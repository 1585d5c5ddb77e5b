"""Writer slots: how many save units may write at once, granted first come, first served.

Plain Python; the monitor actor wraps it with leases so that a writer that dies releases its
slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ckptd.config import SaveStrategy


@dataclass(frozen=True)
class SlotRequest:
    unit: str  # unique key of the unit (label plus step and kind)
    node: str
    process: str


class WriterSlots:
    """A FIFO queue of slot requests and the set of current holders.

    A request is granted when every request ahead of it has been granted and it may run beside
    the current holders: never for ``single_thread`` (one holder at a time), same process for
    ``single_process``, same node for ``single_node``. A request that may not run blocks the
    ones behind it, so nobody starves.
    """

    def __init__(self, strategy: SaveStrategy) -> None:
        self.strategy = strategy
        self._queue: OrderedDict[str, SlotRequest] = OrderedDict()
        self._holders: dict[str, SlotRequest] = {}

    def _group(self, req: SlotRequest) -> str:
        if self.strategy is SaveStrategy.SINGLE_PROCESS:
            return req.process
        if self.strategy is SaveStrategy.SINGLE_NODE:
            return req.node
        return req.unit  # single_thread: every unit is its own group

    def _compatible(self, req: SlotRequest) -> bool:
        if self.strategy is SaveStrategy.UNRESTRICTED or not self._holders:
            return True
        if self.strategy is SaveStrategy.SINGLE_THREAD:
            return False
        group = self._group(req)
        return all(self._group(h) == group for h in self._holders.values())

    def holds(self, unit: str) -> bool:
        return unit in self._holders

    def holders(self) -> list[str]:
        return list(self._holders)

    def waiting(self) -> list[str]:
        return list(self._queue)

    def request(self, req: SlotRequest) -> list[str]:
        """Queue a request (idempotent); return the units granted as a result."""
        if req.unit not in self._holders and req.unit not in self._queue:
            self._queue[req.unit] = req
        return self._grant()

    def adopt(self, req: SlotRequest) -> None:
        """Record a holder the slots did not know of (a writer that survived a monitor restart)."""
        self._queue.pop(req.unit, None)
        self._holders.setdefault(req.unit, req)

    def release(self, unit: str) -> list[str]:
        """Release a held slot or drop a queued request; return the units granted as a result."""
        self._holders.pop(unit, None)
        self._queue.pop(unit, None)
        return self._grant()

    def _grant(self) -> list[str]:
        granted = []
        while self._queue:
            unit, req = next(iter(self._queue.items()))
            if not self._compatible(req):
                break
            del self._queue[unit]
            self._holders[unit] = req
            granted.append(unit)
        return granted
