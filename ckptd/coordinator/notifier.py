"""Notifications from a coordinator's save threads to the monitor, sent in batches."""

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
    done: threading.Event | None = None
    error: BaseException | None = field(default=None)


class Notifier:
    """Sends notifications in order, batching those that queue up while a call is in flight.

    A lone notification goes out at once; when many save threads report together, one call
    carries them all (group commit), so the number of Ray calls does not grow with the units.

    Args:
        send: Delivers a list of events to the monitor (retrying as it sees fit); raises if
            they could not be delivered.
        name: The sending thread's name.
    """

    def __init__(self, send: Callable[[list], None], name: str) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def post(self, event: Any) -> None:
        """Queue ``event`` and return; a failure to deliver it is only logged."""
        with self._cond:
            self._queue.append(_Pending(event))
            self._cond.notify()

    def deliver(self, event: Any) -> None:
        """Queue ``event`` and wait until the monitor has it; raise what delivery raised."""
        pending = _Pending(event, threading.Event())
        with self._cond:
            self._queue.append(pending)
            self._cond.notify()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                batch, self._queue = self._queue, []
            error = None
            try:
                self._send([p.event for p in batch])
            except BaseException as e:  # handed to every waiter below
                error = e
                if any(p.done is None for p in batch):
                    log.warning("could not deliver notifications to the monitor: %s", e)
            for p in batch:
                p.error = error
                if p.done is not None:
                    p.done.set()
