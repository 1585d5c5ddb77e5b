"""What ``monitor.status.remote()`` returns: JSON-serialisable pydantic models."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ckptd.config import Kind, SaveStrategy
from ckptd.monitor.ledger import StepRecord, StepState, UnitFailure


class StepStatus(BaseModel):
    """One (step, kind): the units expected, started, finished and failed, and the outcome."""

    model_config = ConfigDict(frozen=True)

    step: int
    kind: Kind
    state: StepState
    committed: bool
    expected: int | None
    started: list[str]
    finished: list[str]
    failed: list[UnitFailure]
    reason: str | None
    first_seen: float
    ready_at: float | None
    committed_at: float | None

    @classmethod
    def of(cls, rec: StepRecord) -> StepStatus:
        return cls(
            step=rec.step, kind=rec.kind, state=rec.state,
            committed=rec.state is StepState.COMMITTED, expected=rec.expected,
            started=sorted(rec.started), finished=sorted(rec.finished),
            failed=[rec.failed[u] for u in sorted(rec.failed)], reason=rec.reason,
            first_seen=rec.first_seen, ready_at=rec.ready_at, committed_at=rec.committed_at,
        )


class Trackers(BaseModel):
    model_config = ConfigDict(frozen=True)

    checkpoint: int | None
    state_dict: int | None


class WriterSlotsStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    strategy: SaveStrategy
    holders: list[str]
    waiting: list[str]


class RetentionStatus(BaseModel):
    """What retention has done since the monitor started."""

    model_config = ConfigDict(frozen=True)

    passes: int
    deleted_steps: list[int]
    errors: list[str]


class MonitorStatus(BaseModel):
    """The monitor's view of the run. Storage credentials are never included."""

    model_config = ConfigDict(frozen=True)

    run: str
    root: str
    trackers: Trackers
    steps: list[StepStatus]
    writers: WriterSlotsStatus
    retention: RetentionStatus
    notifications: int
    started_at: float

    def step(self, step: int, kind: str | Kind = Kind.CHECKPOINT) -> StepStatus | None:
        """The status of one step and kind, if the monitor still reports it in detail."""
        kind = Kind(kind)
        return next((s for s in self.steps if s.step == step and s.kind is kind), None)
