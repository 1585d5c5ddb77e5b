"""Preemption notices and the outcome of a final save: plain data and the rules that combine them.

No Ray and no signals here, so the rules are unit tested in microseconds; the guard
(:mod:`ckptd.coordinator.preemption`) feeds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel, ConfigDict

#: Exit status after a preemption whose final step was committed (and mirrored, where the monitor
#: has a mirror). Non-zero on purpose: the job did not finish, so a scheduler must run it again
#: (Kubernetes, Slurm, Ray Jobs and torchrun all treat 0 as "done"). 75 is ``EX_TEMPFAIL`` in
#: ``sysexits.h`` ("temporary failure; try again"), distinct from 1 (an exception), 137 (SIGKILL)
#: and 143 (killed by SIGTERM without a save), so a policy can match it, e.g. a Kubernetes
#: ``podFailurePolicy`` rule ``onExitCodes: {operator: In, values: [75]}`` with ``action: Ignore``.
PREEMPTED_EXIT_CODE = 75

#: Exit status after a preemption whose final save was not committed in time (or failed): the
#: job resumes from the newest earlier commit. 74 is ``EX_IOERR`` in ``sysexits.h``.
PREEMPTION_INCOMPLETE_EXIT_CODE = 74


class NoticeSource(str, Enum):
    """Where a preemption notice came from."""

    SIGNAL = "signal"  # SIGTERM (or another signal the guard was given) in this process
    RAY_DRAIN = "ray_drain"  # the Ray node this process runs on is being drained
    PEER = "peer"  # another rank had a notice (agreed at a step boundary)
    MANUAL = "manual"  # PreemptionGuard.notify()


@dataclass(frozen=True)
class Notice:
    """One preemption notice.

    Attributes:
        source: Where it came from.
        received_at: When this process learned of it (``time.time()``).
        deadline: When the final save must be done (``time.time()`` scale), or None for "no
            deadline given by the source": the guard's grace period applies.
        detail: The signal's name, Ray's drain reason, and the like (for the log).
    """

    source: NoticeSource
    received_at: float
    deadline: float | None = None
    detail: str = ""


def deadline_of(notice: Notice, grace_s: float) -> float:
    """When the final save must be done: ``grace_s`` after the notice, or the notice's own deadline
    when that is sooner (a Ray drain deadline, say)."""
    own = notice.received_at + grace_s
    return own if notice.deadline is None else min(own, notice.deadline)


def earliest(first: Notice | None, second: Notice | None) -> Notice | None:
    """Of two notices, the one to act on: the first received, with the sooner of the deadlines."""
    if first is None or second is None:
        return first or second
    keep, other = (first, second) if first.received_at <= second.received_at else (second, first)
    deadlines = [d for d in (keep.deadline, other.deadline) if d is not None]
    return Notice(keep.source, keep.received_at, min(deadlines) if deadlines else None, keep.detail)


def encode_for_agreement(notice: Notice | None, grace_s: float) -> tuple[float, float]:
    """This rank's vote for the all-reduce (MIN) at a step boundary: ``(-1 if preempted else 0,
    deadline or +inf)``."""
    if notice is None:
        return 0.0, math.inf
    return -1.0, deadline_of(notice, grace_s)


def decode_agreement(flag: float, deadline: float, mine: Notice | None, now: float) -> Notice | None:
    """The notice every rank acts on after the all-reduce: this rank's own (with the group's
    soonest deadline), a notice from a peer, or None when no rank has one."""
    if flag >= 0:
        return None
    deadline = None if math.isinf(deadline) else deadline
    if mine is None:
        return Notice(NoticeSource.PEER, now, deadline, "another rank was told to stop")
    return Notice(mine.source, mine.received_at, deadline if mine.deadline is None else min(deadline, mine.deadline),
                  mine.detail)


def already_saved(step: int, last_saved: int | None) -> bool:
    """Whether this process has already started a save of ``step`` (or of a later step), so the
    final save must wait for that one instead of saving the step again."""
    return last_saved is not None and last_saved >= step


class PreemptionOutcome(BaseModel):
    """What the final save after a preemption notice achieved.

    Attributes:
        step: The final step: the one the training loop had just completed.
        source: Where the notice came from.
        detail: More about the notice (the signal, Ray's drain message).
        saved: True if the final save was started for the notice; False when a save of this step
            was already in flight or done and was waited for instead.
        committed: The step is committed on the root.
        mirrored: The step is on the mirror; None when the monitor has no mirror (or mirror
            waiting was turned off).
        deadline: When the final save had to be done (``time.time()`` scale).
        elapsed_s: Seconds from the notice to this outcome.
        error: Why the final step is not committed (and mirrored), or an earlier save's failure
            that ``wait_all`` reported meanwhile; None when all went well.
    """

    model_config = ConfigDict(frozen=True)

    step: int
    source: NoticeSource
    detail: str
    saved: bool
    committed: bool
    mirrored: bool | None
    deadline: float
    elapsed_s: float
    error: str | None

    @property
    def complete(self) -> bool:
        """The final step is committed, and mirrored where a mirror is waited for."""
        return self.committed and self.mirrored is not False

    @property
    def exit_code(self) -> int:
        """:data:`PREEMPTED_EXIT_CODE` when complete, else :data:`PREEMPTION_INCOMPLETE_EXIT_CODE`."""
        return PREEMPTED_EXIT_CODE if self.complete else PREEMPTION_INCOMPLETE_EXIT_CODE
