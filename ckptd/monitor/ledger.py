"""The step ledger and the commit rule: plain Python, no Ray, no I/O.

Step S of kind K may be committed exactly when the expected unit count for (S, K) has been
registered, that many distinct units have finished, and none has failed. Notifications may
arrive in any order and more than once; a duplicate counts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pydantic import BaseModel, ConfigDict

from ckptd.config import Kind
from ckptd.errors import RegistrationConflictError
from ckptd.manifest import FileEntry
from ckptd.units import UnitId


class StepState(str, Enum):
    PENDING = "pending"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"


class UnitFailure(BaseModel):
    """Why a unit failed: the exception's type, message and formatted traceback."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unit: str
    error_type: str
    message: str
    traceback: str = ""

    @property
    def cause(self) -> str:
        return f"{self.error_type}: {self.message}"


@dataclass
class StepRecord:
    step: int
    kind: Kind
    first_seen: float
    expected: int | None = None
    registered_at: float | None = None
    started: set[str] = field(default_factory=set)
    finished: dict[str, list[FileEntry]] = field(default_factory=dict)
    failed: dict[str, UnitFailure] = field(default_factory=dict)
    state: StepState = StepState.PENDING
    reason: str | None = None
    ready_at: float | None = None  # when the commit rule was met (the last unit reported)
    committed_at: float | None = None

    @property
    def key(self) -> tuple[int, Kind]:
        return (self.step, self.kind)

    def units_seen(self) -> set[str]:
        # start(), finish() and fail() all record the unit in ``started``; no union needed,
        # which keeps a notification O(1) however many units a step has.
        return self.started

    def failure_summary(self) -> tuple[str | None, str]:
        """(failed unit or None, cause) for a failed step."""
        if self.failed:
            unit, failure = sorted(self.failed.items())[0]
            return unit, failure.cause
        return None, self.reason or "unknown reason"


class StepLedger:
    """Per (step, kind): the registration, the units seen, and the step's state.

    Args:
        step_timeout_s: A step not committed this long after it was first seen (registration
            or any notification) is failed by :meth:`expire`.
    """

    def __init__(self, step_timeout_s: float) -> None:
        self.step_timeout_s = step_timeout_s
        self._records: dict[tuple[int, Kind], StepRecord] = {}
        # Steps dropped from the detailed records (see prune): enough to answer late callers.
        self._retired_committed: set[tuple[int, Kind]] = set()
        self._retired_failed: dict[tuple[int, Kind], tuple[str | None, str]] = {}

    # -- lookups -------------------------------------------------------------------------------

    def get(self, step: int, kind: Kind) -> StepRecord | None:
        return self._records.get((step, kind))

    def records(self) -> list[StepRecord]:
        return sorted(self._records.values(), key=lambda r: (r.step, r.kind.value))

    def is_committed(self, step: int, kind: Kind) -> bool:
        rec = self._records.get((step, kind))
        if rec is not None:
            return rec.state is StepState.COMMITTED
        return (step, kind) in self._retired_committed

    def failure_of(self, step: int, kind: Kind) -> tuple[str | None, str] | None:
        """(unit, cause) if the step failed, else None."""
        rec = self._records.get((step, kind))
        if rec is not None:
            return rec.failure_summary() if rec.state is StepState.FAILED else None
        return self._retired_failed.get((step, kind))

    def in_flight_steps(self) -> set[int]:
        """Steps with a kind still pending or committing."""
        return {r.step for r in self._records.values() if r.state in (StepState.PENDING, StepState.COMMITTING)}

    def failed_steps(self) -> set[int]:
        """Steps with a kind that failed (including those dropped from the detailed records)."""
        failed = {r.step for r in self._records.values() if r.state is StepState.FAILED}
        return failed | {step for step, _ in self._retired_failed}

    def _record(self, step: int, kind: Kind, now: float) -> StepRecord:
        rec = self._records.get((step, kind))
        if rec is None:
            rec = StepRecord(step=step, kind=kind, first_seen=now)
            if (step, kind) in self._retired_committed:
                rec.state = StepState.COMMITTED
            elif (step, kind) in self._retired_failed:
                rec.state = StepState.FAILED
                rec.reason = self._retired_failed[(step, kind)][1]
            self._records[(step, kind)] = rec
        return rec

    # -- events --------------------------------------------------------------------------------

    def mark_committed(self, step: int, kind: Kind, now: float) -> StepRecord:
        """Record a step found committed in storage (a manifest exists)."""
        rec = self._record(step, kind, now)
        rec.state = StepState.COMMITTED
        rec.committed_at = rec.committed_at or now
        return rec

    def check_registration(self, step: int, kind: Kind, count: int) -> None:
        """Raise RegistrationConflictError if registering ``count`` units would conflict."""
        rec = self._records.get((step, kind))
        if count < 1:
            raise RegistrationConflictError(f"step {step} ({kind.value}): unit count must be >= 1")
        if rec is not None and rec.expected is not None and rec.expected != count:
            raise RegistrationConflictError(
                f"step {step} ({kind.value}) was already registered with {rec.expected} units; "
                f"this registration says {count}. Register each step once with the total number "
                "of save units across all workers"
            )

    def register(self, step: int, kind: Kind, count: int, now: float) -> StepRecord:
        self.check_registration(step, kind, count)
        rec = self._record(step, kind, now)
        if rec.expected is None:
            rec.expected = count
            rec.registered_at = now
        self._check_extra_units(rec)
        return rec

    def start(self, unit: UnitId, now: float) -> StepRecord:
        rec = self._record(unit.step, unit.kind, now)
        if rec.state in (StepState.PENDING, StepState.COMMITTING):
            rec.started.add(unit.label)
            self._check_extra_units(rec)
        return rec

    def finish(self, unit: UnitId, files: list[FileEntry], now: float) -> StepRecord:
        rec = self._record(unit.step, unit.kind, now)
        if rec.state is StepState.PENDING and unit.label not in rec.finished:
            rec.finished[unit.label] = list(files)
            rec.started.add(unit.label)
            self._check_extra_units(rec)
        return rec

    def fail(self, unit: UnitId, failure: UnitFailure, now: float) -> StepRecord:
        rec = self._record(unit.step, unit.kind, now)
        if rec.state is StepState.COMMITTED:
            return rec  # a late duplicate of a unit that did finish; the commit stands
        rec.failed.setdefault(unit.label, failure)
        rec.started.add(unit.label)
        if rec.state is StepState.PENDING:
            rec.state = StepState.FAILED
        return rec

    def _check_extra_units(self, rec: StepRecord) -> None:
        if rec.state is not StepState.PENDING or rec.expected is None:
            return
        seen = rec.units_seen()
        if len(seen) > rec.expected:
            self.fail_step(
                rec,
                f"{len(seen)} units saved step {rec.step} ({rec.kind.value}) but only "
                f"{rec.expected} were registered ({', '.join(sorted(seen))}); the registered "
                "count must include every save unit of the step",
            )

    def is_ready(self, rec: StepRecord) -> bool:
        """The commit rule."""
        return (
            rec.state is StepState.PENDING
            and rec.expected is not None
            and len(rec.finished) == rec.expected
            and not rec.failed
        )

    def begin_commit(self, rec: StepRecord, now: float | None = None) -> None:
        assert self.is_ready(rec), rec
        rec.state = StepState.COMMITTING
        rec.ready_at = now

    def commit_done(self, rec: StepRecord, now: float) -> None:
        rec.state = StepState.COMMITTED
        rec.committed_at = now

    def fail_step(self, rec: StepRecord, reason: str) -> None:
        if rec.state in (StepState.PENDING, StepState.COMMITTING):
            rec.state = StepState.FAILED
            rec.reason = reason

    def expire(self, now: float) -> list[StepRecord]:
        """Fail every pending step first seen more than ``step_timeout_s`` ago; return them."""
        expired = []
        for rec in self._records.values():
            if rec.state is not StepState.PENDING:
                continue
            if now - rec.first_seen < self.step_timeout_s:
                continue
            if rec.expected is None:
                detail = "it was never registered (call register_and_monitor for every saved step)"
            else:
                missing = rec.expected - len(rec.finished)
                detail = (
                    f"{len(rec.finished)} of {rec.expected} registered units finished "
                    f"({missing} missing; finished: {', '.join(sorted(rec.finished)) or 'none'})"
                )
            self.fail_step(rec, f"timed out after {self.step_timeout_s:g} s: {detail}")
            expired.append(rec)
        return expired

    def prune(self, keep: int) -> None:
        """Drop the details of all but the newest ``keep`` committed or failed steps."""
        done = [r for r in self._records.values() if r.state in (StepState.COMMITTED, StepState.FAILED)]
        done.sort(key=lambda r: (r.step, r.kind.value))
        for rec in done[: max(0, len(done) - keep)]:
            del self._records[rec.key]
            if rec.state is StepState.COMMITTED:
                self._retired_committed.add(rec.key)
            else:
                self._retired_failed[rec.key] = rec.failure_summary()
