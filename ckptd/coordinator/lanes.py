"""Named save threads: units of the same name run one after another, in call order."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptd.protocol import UnitId
from ckptd.threads import lower_priority

log = logging.getLogger("ckptd.coordinator")


@dataclass
class Job:
    unit: UnitId
    save_fn: Callable[[], Any]


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
                run(job)
            except BaseException:
                # run() reports every failure itself; what still escapes (an interrupt) must not
                # end the thread, or later saves of this name would wait forever.
                log.exception("save thread %s: a unit ended abnormally", threading.current_thread().name)
            finally:
                self.queue.task_done()
