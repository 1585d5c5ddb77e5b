"""Writer slots with leases, on the monitor's event loop (the queue itself is :mod:`throttle`).

Exclusion must survive a monitor restart: a writer granted a slot before the restart keeps
writing, and re-announces its slot when it next renews (every ``slot_lease_s / 3``). So a
restarted monitor grants nothing for half a lease period, by which time every live holder has
re-announced. A released slot is remembered, so a renewal that arrives after its unit finished
cannot take it again (unit keys are unique; a released key is never legitimately held again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from ckptd.config import SaveStrategy
from ckptd.monitor.throttle import SlotRequest, WriterSlots

log = logging.getLogger("ckptd.monitor")

_RELEASED_MEMORY = 100_000


class SlotLeases:
    """Grants writer slots first come, first served, and takes back those whose holder died.

    Args:
        strategy: The run's save strategy.
        lease_s: A holder that has not renewed for this long loses its slot.
        restarted: This monitor replaces one that may have granted slots: grant nothing for
            ``lease_s / 2``.
    """

    def __init__(self, strategy: SaveStrategy, lease_s: float, restarted: bool) -> None:
        self.strategy = strategy
        self.lease_s = lease_s
        self._slots = WriterSlots(strategy)
        self._waiters: dict[str, asyncio.Future] = {}
        self._leases: dict[str, float] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        throttled = strategy is not SaveStrategy.UNRESTRICTED
        self._frozen_until = time.monotonic() + lease_s / 2 if restarted and throttled else 0.0

    def holders(self) -> list[str]:
        return self._slots.holders()

    def waiting(self) -> list[str]:
        return self._slots.waiting()

    async def acquire(self, key: str, node: str, process: str) -> dict:
        """Wait for a slot: ``{"granted": True}``, or ``{"aborted": cause}``."""
        if key in self._released:
            return {"aborted": "the unit already reported its outcome"}
        if not self._slots.holds(key):
            fut = self._waiters.get(key)
            if fut is None or fut.done():
                fut = asyncio.get_running_loop().create_future()
                self._waiters[key] = fut
            wait = self._frozen_until - time.monotonic()
            if wait > 0:
                # Holders granted before a restart re-announce meanwhile (renew).
                await asyncio.sleep(wait)
            if key in self._released:
                return {"aborted": "the unit already reported its outcome"}
            self._grant(self._slots.request(SlotRequest(key, node, process)))
            result = await asyncio.shield(fut)
            if "aborted" in result:
                return result
        self._leases[key] = time.monotonic() + self.lease_s
        return {"granted": True}

    def renew(self, held: list[tuple[str, str, str]]) -> None:
        """Extend the leases of slots a coordinator still holds (its writers are alive)."""
        deadline = time.monotonic() + self.lease_s
        for key, node, process in held:
            if key in self._released:
                continue  # a renewal that crossed the unit's outcome: the slot stays released
            if not self._slots.holds(key) and key not in self._slots.waiting():
                # A writer granted by the monitor before it restarted: count it again.
                self._slots.adopt(SlotRequest(key, node, process))
            if self._slots.holds(key):
                self._leases[key] = deadline

    def release(self, key: str, cause: str = "the unit reported its outcome before it was granted a slot") -> None:
        self._released[key] = None
        while len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)
        self._leases.pop(key, None)
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result({"aborted": cause})
        self._grant(self._slots.release(key))

    def abort_prefix(self, prefix: str, cause: str) -> None:
        """Abort every waiter whose key starts with ``prefix`` (a step that failed)."""
        for key in [k for k in self._waiters if k.startswith(prefix)]:
            self.release(key, cause)

    def expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, t in self._leases.items() if t < now]:
            log.warning("writer slot %s expired: its writer stopped renewing it", key)
            self.release(key)

    def _grant(self, keys: list[str]) -> None:
        for key in keys:
            fut = self._waiters.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result({"granted": True})
