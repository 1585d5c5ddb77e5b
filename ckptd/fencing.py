"""Attempts as both sides see them: every job that starts a monitor on a root opens the next
attempt (``root/.ckptd/attempts/{n}.json``), and only the newest attempt publishes.

The monitor checks before every manifest and tracker; a coordinator's save units check before
every file the writers of ckptd publish into the root (:func:`check_fence` through
:func:`ckptd.commit.publish_guard`), so a process that outlived its job cannot replace a file
of the next job's checkpoint. Opening an attempt and cleaning up after older ones is the
monitor's (:mod:`ckptd.monitor.attempts`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from ckptd.errors import CheckpointError
from ckptd.layout import attempts_dir, list_attempts
from ckptd.storage import Storage

#: Who was fenced: the monitor (manifests and trackers) or a save unit (its files).
Fenced = Literal["monitor", "save"]


class FencedError(CheckpointError):
    """A newer attempt owns the root: this process must not publish anything into it."""

    def __init__(self, mine: int, newer: int, run: str, who: Fenced = "monitor") -> None:
        self.mine, self.newer, self.run, self.who = mine, newer, run, who
        superseded = f"attempt {mine} of this root was superseded by attempt {newer} (run {run!r})"
        if who == "monitor":
            super().__init__(f"{superseded}; this monitor no longer publishes manifests or trackers. Stop it, "
                             "or start one job per root")
        else:
            super().__init__(f"{superseded}: this process belongs to the older job, and its save did not "
                             "publish into the root. Stop a job's processes before starting the next job on "
                             "its root")

    def __reduce__(self):
        return (type(self), (self.mine, self.newer, self.run, self.who))


class AttemptRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    attempt: int
    run: str
    namespace: str | None
    root: str
    started_at: float
    host: str


def read_attempt(storage: Storage, attempt: int) -> AttemptRecord | None:
    text = storage.read_text_or_none(f"{attempts_dir(storage)}/{attempt}.json")
    return None if text is None else AttemptRecord.model_validate_json(text)


def current_attempt(storage: Storage) -> AttemptRecord | None:
    """The newest attempt's record, or None if there is none. One taken back between the
    listing and the read (a ``start_monitor`` that lost a race) is skipped for the next newest."""
    for attempt in reversed(list_attempts(storage)):
        record = read_attempt(storage, attempt)
        if record is not None:
            return record
    return None


def _read_any(storage: Storage, attempt: int) -> AttemptRecord | None:
    """:func:`read_attempt`, with a record that does not parse standing as one of an unknown run:
    whoever wrote it opened that attempt all the same."""
    try:
        return read_attempt(storage, attempt)
    except ValueError:  # pydantic's ValidationError
        return AttemptRecord(attempt=attempt, run="?", namespace=None, root=storage.url, started_at=0.0, host="?")


def newer_attempts(storage: Storage, mine: int) -> list[AttemptRecord]:
    """The records of the attempts newer than ``mine``, oldest first; one taken back between the
    listing and the read is left out."""
    records = (_read_any(storage, attempt) for attempt in list_attempts(storage) if attempt > mine)
    return [r for r in records if r is not None]


def check_fence(storage: Storage, mine: int, who: Fenced = "monitor") -> None:
    """Raise FencedError unless ``mine`` is still the newest attempt of the root."""
    attempts = list_attempts(storage)
    if attempts and attempts[-1] > mine:
        newer = _read_any(storage, attempts[-1])
        raise FencedError(mine, attempts[-1], newer.run if newer else "?", who)
