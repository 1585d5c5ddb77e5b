"""Retention's claims: the steps a pass is deleting right now.

A pass decides in a thread, from a snapshot of what was in flight and a scan of the root. Right
before each deletion it claims the step on the monitor's event loop, where admissions and
registrations run: the claim looks again (``may_delete``), and a claimed step's units and
registrations wait (:attr:`DeletionClaims.deleting`) until its deletion is over, so nothing is
admitted into a directory on its way to the trash.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.layout import StepEntry

#: A loop that does not answer a claim for this long: the pass fails, and is retried later.
LOOP_CALL_TIMEOUT_S = 60.0


@dataclass
class _Ticket:
    """One claim asked from the pass's thread. A thread that stopped waiting marks it abandoned;
    a claim made on the loop marks it claimed: whichever comes second, nothing stays claimed."""
    abandoned: bool = False
    claimed: bool = False


class DeletionClaims:
    """Args:
        may_delete: Runs on the event loop: whether the step of an entry may be deleted now.
    """

    def __init__(self, may_delete: Callable[[StepEntry], bool]) -> None:
        self._may_delete = may_delete
        self.deleting: dict[int, asyncio.Event] = {}  # claimed steps; each event is set on release
        self.committed: set[int] = set()  # those of them with a manifest
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def claim(self, entry: StepEntry, timeout_s: float | None = None) -> bool:
        """From the pass's thread: claim ``entry``'s step, or False (keep it).

        Raises:
            TimeoutError: the event loop did not answer in time (then nothing stays claimed).
        """
        ticket = _Ticket()

        async def on_loop() -> bool:
            return self._claim(entry, ticket)

        future = asyncio.run_coroutine_threadsafe(on_loop(), self._loop)
        try:
            return future.result(LOOP_CALL_TIMEOUT_S if timeout_s is None else timeout_s)
        except TimeoutError:
            with self._lock:
                ticket.abandoned = True
                claimed = ticket.claimed
            if claimed:  # made on the loop just now, after all
                self.release(entry.step)
            raise

    def confirm(self, entry: StepEntry) -> bool:
        """From the pass's thread, for a step it claimed, right before the deletion: whether it
        may still be deleted (a withdrawal that began since the claim may need it kept).

        Raises:
            TimeoutError: the event loop did not answer in time (the step is kept).
        """

        async def on_loop() -> bool:
            return self._may_delete(entry)

        return asyncio.run_coroutine_threadsafe(on_loop(), self._loop).result(LOOP_CALL_TIMEOUT_S)

    def release(self, step: int) -> None:
        """From the pass's thread: the deletion of ``step`` is over (done or not). Never blocks."""
        self._loop.call_soon_threadsafe(self._release, step)

    def _claim(self, entry: StepEntry, ticket: _Ticket) -> bool:
        if entry.step in self.deleting or not self._may_delete(entry):
            return False
        with self._lock:
            if ticket.abandoned:  # the thread gave up: it would never release the step
                return False
            ticket.claimed = True
        self.deleting[entry.step] = asyncio.Event()
        if entry.committed:
            self.committed.add(entry.step)
        return True

    def _release(self, step: int) -> None:
        event = self.deleting.pop(step, None)
        self.committed.discard(step)
        if event is not None:
            event.set()
