"""What ``monitor.status.remote()`` returns: JSON-serialisable pydantic models."""

from __future__ import annotations

from enum import Enum

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


class StorageStatus(BaseModel):
    """How the monitor reaches the root, and the shared-root checks it made."""

    model_config = ConfigDict(frozen=True)

    commit_strategy: str
    monitor: str
    probes_checked: int
    unshared: list[str]


class MirrorState(str, Enum):
    """Where one step's upload to the mirror stands."""

    QUEUED = "queued"
    UPLOADING = "uploading"
    MIRRORED = "mirrored"
    FAILED = "failed"  # tried again after retry_after_s, or at monitor.retry_mirror()
    ABANDONED = "abandoned"  # the local copy does not match its manifest: never uploaded


class MirrorStepStatus(BaseModel):
    """One step's upload to the mirror."""

    model_config = ConfigDict(frozen=True)

    step: int
    state: MirrorState
    attempts: int
    error: str | None
    bytes: int
    queued_at: float
    finished_at: float | None


class MirrorStatus(BaseModel):
    """The mirror tier: what is on it, what is waiting, and what went wrong."""

    model_config = ConfigDict(frozen=True)

    url: str
    trackers: Trackers
    queued: list[int]
    uploading: int | None
    steps: list[MirrorStepStatus]
    retried_requests: int
    uploaded_bytes: int
    start_error: str | None
    deleted_steps: list[int]
    retention_errors: list[str]

    def step(self, step: int) -> MirrorStepStatus | None:
        return next((s for s in self.steps if s.step == step), None)


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
    storage: StorageStatus
    mirror: MirrorStatus | None
    started_at: float

    def step(self, step: int, kind: str | Kind = Kind.CHECKPOINT) -> StepStatus | None:
        """The status of one step and kind, if the monitor still reports it in detail."""
        kind = Kind(kind)
        return next((s for s in self.steps if s.step == step and s.kind is kind), None)
