"""Named save threads: units of the same name run one after another, in call order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptd.protocol import UnitId
from ckptd.threads import lower_priority


@dataclass
class Job:
    unit: UnitId
    save_fn: Callable[[], Any]
    #: Runs once the unit has ended, whether or not ``save_fn`` ran: a unit refused before it
    #: starts (its step already failed) never calls ``save_fn``, and what it holds (a staged
    #: save's buffers) must still be handed back.
    finish: Callable[[], None] | None = None
    #: Returns once the registrations this coordinator made before the save call (with
    #: ``wait=False``) were applied: the unit writes its finished receipt only after (with writer
    #: slots, it starts only after), so that a step never commits on the counts of fewer
    #: registrations than were made before its units. It raises if one of them, of the unit's
    #: step, went unanswered (it may still be applied): the unit then fails.
    registered: Callable[[], None] | None = None


class Lane:
    """One named save thread, fed by a bounded queue (``save_async`` blocks when it is full)."""

    def __init__(self, name: str, run: Callable[[Job], None], max_pending: int) -> None:
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_pending)
        self.thread = threading.Thread(target=self._loop, args=(run,), name=f"ckptd-save-{name}", daemon=True)
        self.thread.start()

    def _loop(self, run: Callable[[Job], None]) -> None:
        lower_priority()
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                run(job)  # never raises: the coordinator keeps every failure for wait_all()
            finally:
                self.queue.task_done()
