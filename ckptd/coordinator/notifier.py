"""Notifications from a coordinator's save threads to the monitor, batched when they pile up."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ckptd.coordinator")


@dataclass
class _Pending:
    event: Any
    waits: bool
    done: bool = False
    error: BaseException | None = None
    result: Any = None
    # Set when the event was delivered (done), or when its thread is to send the queue next.
    wake: threading.Event = field(default_factory=threading.Event)


class Notifier:
    """Sends notifications in order; those that queue up while a call is in flight go together.

    Group commit without a thread of its own: a save thread that finds no call in flight sends
    its notification itself, at the cost of one round trip, as an unbatched call would. Threads
    that arrive meanwhile queue up, and when the call returns one of them sends everything that
    queued in one call. So a lone notification costs no extra hand-off, and a burst of units
    costs a few calls instead of one per unit.

    Each waiting thread has its own wake-up: a call's return wakes the threads whose events it
    carried and the one that sends next, not every thread waiting (a process that hosts many
    coordinators has hundreds of save threads on one notifier).

    Args:
        send: Delivers a list of events to the monitor (retrying as it sees fit) and returns
            one result per event; raises if they could not be delivered.
    """

    def __init__(self, send: Callable[[list], list | None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._sending = False

    def post(self, event: Any) -> None:
        """Deliver ``event`` without waiting for a call in flight; failures are only logged."""
        self._submit(_Pending(event, waits=False))

    def deliver(self, event: Any) -> Any:
        """Deliver ``event``; return the monitor's answer to it once it has it, or raise what
        delivery raised."""
        pending = _Pending(event, waits=True)
        self._submit(pending)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _submit(self, pending: _Pending) -> None:
        with self._lock:
            self._queue.append(pending)
            sender = not self._sending
            self._sending = True
        if not sender:
            if not pending.waits:
                return  # queued behind the call in flight; its sender flushes it after
            pending.wake.wait()
            if pending.done:
                return
            # Woken with its event still queued: this thread sends next.
        self._send_queued()

    def _send_queued(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
            error = None
            results: list | None = None
            try:
                results = self._send([p.event for p in batch])
            except BaseException as e:  # handed to every waiter in the batch
                error = e
                if any(not p.waits for p in batch):
                    log.warning("could not deliver notifications to the monitor: %s", e)
            for i, p in enumerate(batch):
                p.error = error
                p.result = results[i] if results is not None and i < len(results) else None
                p.done = True
                p.wake.set()
            with self._lock:
                if not self._queue:
                    self._sending = False
                    return
                successor = next((p for p in self._queue if p.waits), None)
                if successor is not None:
                    successor.wake.set()  # a thread waiting in the queue takes over
                    return
            # Only posts queued: flushed from here.
