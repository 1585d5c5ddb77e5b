"""What ``monitor.status.remote()`` returns: JSON-serialisable pydantic models."""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict

from ckptd.config import Kind, SaveStrategy
from ckptd.monitor.ledger import StepRecord, StepState
from ckptd.protocol import UnitFailure


class StepStatus(BaseModel):
    """One (step, kind): the units registered, seen, finished and failed, and the outcome.

    Units are named ``worker/name#call``: two save calls with the same name are two units.
    """

    model_config = ConfigDict(frozen=True)

    step: int
    kind: Kind
    state: StepState
    committed: bool
    expected: int
    monitored: bool
    started: list[str]
    finished: list[str]
    failed: list[UnitFailure]
    reason: str | None
    first_seen: float
    ready_at: float | None
    committed_at: float | None

    @classmethod
    def of(cls, rec: StepRecord, kind: Kind, units: bool = True) -> StepStatus:
        """``units=False`` leaves the unit lists empty (O(1) instead of O(units))."""
        k = rec[kind]
        mine = sorted((u for u in rec.units.values() if u.unit.kind is kind), key=lambda u: u.unit.key) \
            if units else []
        return cls(
            step=rec.step, kind=kind, state=k.state, committed=k.state is StepState.COMMITTED,
            expected=k.expected, monitored=k.monitored, started=[u.unit.key for u in mine],
            finished=[u.unit.key for u in mine if u.files is not None],
            failed=[u.failure for u in mine if u.failure is not None], reason=k.reason,
            first_seen=rec.first_seen, ready_at=k.ready_at, committed_at=k.committed_at,
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
    #: Why nothing is uploaded: an upload found a newer attempt on the root. Lifted if that attempt
    #: goes (a ``start_monitor`` that lost a race took it back).
    fenced: str | None = None

    def step(self, step: int) -> MirrorStepStatus | None:
        return next((s for s in self.steps if s.step == step), None)


class SubscriberStatus(BaseModel):
    """A weight subscriber (a rollout worker): what it serves, and how far behind the newest commit.

    ``lag_steps`` and ``lag_s`` are None until it reports a version; ``lag_s`` counts from the
    first commit newer than what it serves (0 while it serves the newest).
    """

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    kind: Kind
    where: str
    live: bool
    last_seen: float
    serving: int | None
    serving_since: float | None
    lag_steps: int | None
    lag_s: float | None
    pins: list[int]


class PinStatus(BaseModel):
    """A read lease: retention keeps ``step`` while it lasts."""

    model_config = ConfigDict(frozen=True)

    lease: str
    subscriber: str
    step: int
    expires_in_s: float


class MonitorStatus(BaseModel):
    """The monitor's view of the run. Storage credentials are never included."""

    model_config = ConfigDict(frozen=True)

    run: str
    root: str
    attempt: int
    fenced: str | None
    trackers: Trackers
    steps: list[StepStatus]
    writers: WriterSlotsStatus
    retention: RetentionStatus
    notifications: int
    storage: StorageStatus
    mirror: MirrorStatus | None
    started_at: float
    warnings: list[str]
    subscribers: list[SubscriberStatus] = []
    pins: list[PinStatus] = []

    def subscriber(self, name: str) -> SubscriberStatus | None:
        """The subscriber of that name (the newest, if several have it)."""
        found = [s for s in self.subscribers if s.name == name]
        return max(found, key=lambda s: s.last_seen) if found else None

    def step(self, step: int, kind: str | Kind = Kind.CHECKPOINT) -> StepStatus | None:
        """The status of one step and kind, if the monitor still reports it in detail."""
        kind = Kind(kind)
        return next((s for s in self.steps if s.step == step and s.kind is kind), None)


def build_status(monitor: Any, units: bool = True) -> MonitorStatus:
    """The status of a :class:`~ckptd.monitor.actor.CheckpointMonitor` (read on its event loop).
    ``units=False``: without the steps' unit lists, for the gauges (every second, whatever the
    number of units)."""
    ledger, opts = monitor._ledger, monitor._opts
    steps = [StepStatus.of(rec, kind, units) for rec in ledger.records() for kind in Kind if rec.active(kind)]
    retention = monitor._retention
    return MonitorStatus(
        run=monitor._run,
        root=monitor._storage.url,
        attempt=monitor._attempt,
        fenced=monitor._why_fenced(),
        trackers=Trackers(checkpoint=monitor._trackers[Kind.CHECKPOINT], state_dict=monitor._trackers[Kind.STATE_DICT]),
        steps=steps,
        writers=WriterSlotsStatus(strategy=opts.save_strategy, holders=monitor._slots.holders(),
                                  waiting=monitor._slots.waiting()),
        retention=RetentionStatus(passes=retention.passes, deleted_steps=list(retention.deleted),
                                  errors=list(retention.errors)),
        notifications=monitor._notifications,
        storage=StorageStatus(commit_strategy=monitor._storage.commit.name, monitor=monitor._where,
                              probes_checked=monitor._probes_checked, unshared=list(monitor._unshared)),
        mirror=None if monitor._mirror is None else monitor._mirror.status(),
        started_at=monitor._started_at,
        warnings=ledger.warnings(time.time()),
        subscribers=_subscribers(monitor),
        pins=_pins(monitor),
    )


def _subscribers(monitor: Any) -> list[SubscriberStatus]:
    readers, now = monitor._readers, time.time()
    leases = readers.leases()
    out = []
    for sub in readers.subscribers():
        lag_steps, lag_s = readers.lag(sub, monitor._trackers[sub.kind], now)
        out.append(SubscriberStatus(
            id=sub.sub_id, name=sub.name, kind=sub.kind, where=sub.where, live=readers.live(sub, now),
            last_seen=sub.last_seen, serving=sub.serving, serving_since=sub.serving_since, lag_steps=lag_steps,
            lag_s=lag_s, pins=sorted({lease.step for lease in leases if lease.holder == sub.sub_id}),
        ))
    return out


def _pins(monitor: Any) -> list[PinStatus]:
    readers, now = monitor._readers, time.time()
    names = {s.sub_id: s.name for s in readers.subscribers()}
    return [PinStatus(lease=lease.lease_id, subscriber=names.get(lease.holder, lease.holder), step=lease.step,
                      expires_in_s=max(0.0, lease.expires - now)) for lease in readers.leases()]
