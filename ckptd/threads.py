"""Background threads that yield the CPU to training."""

from __future__ import annotations

import os
import threading

#: Nice value of ckptd's save, staging and checksum threads (Linux schedules threads separately).
BACKGROUND_NICE = 10


def lower_priority() -> None:
    """Lower the calling thread's CPU priority to :data:`BACKGROUND_NICE`.

    On a machine whose cores are all busy, the training thread then gets the CPU first and a
    save takes longer instead; on an idle core the save runs at full speed either way. A no-op
    where threads cannot be reniced.
    """
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass
