"""What coordinators and the monitor share: ids, the records both write and read, and names.

Neither side imports the other's internals; both import this module. It holds:

* the monitor actor's name;
* :class:`UnitId`: one save unit, that is one ``save_async`` / ``save_sync`` call. Its ``call``
  id is unique across the run, so two calls with the same name and step are two units, and a
  notification that Ray or ckptd retries is the same unit;
* the timing a coordinator sends with its notifications (:class:`TimingOutbox`): when each unit
  ran and how long the training thread was blocked in save calls, in that process's wall clock,
  for ``ckptd timeline``;
* the ledger records under ``root/.ckptd/pending/{attempt}/{step}/``: registrations (written by
  the monitor before it acknowledges them), unit receipts (written by workers before they report
  a unit) and step failures (written by the monitor before it reports them). A restarted monitor
  rebuilds every step in flight from these alone. Records live under the attempt that wrote
  them, so a new job never counts a dead job's records.

Every record is small JSON published atomically; file names are ids ckptd generated, never
user-chosen names, so two units can never share a receipt.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from ckptd.config import Kind
from ckptd.errors import CorruptCheckpointError
from ckptd.layout import attempt_pending_dir, pending_root, step_failure_path, step_pending_dir
from ckptd.manifest import FileEntry
from ckptd.storage import Storage

log = logging.getLogger(__name__)



def actor_name(run: str) -> str:
    """The Ray actor name of the monitor of ``run``."""
    return f"ckptd-monitor-{run}"


def monitor_actor(run: str, namespace: str | None) -> Any:
    """The run's monitor actor on the connected Ray cluster: in ``namespace``; with None, in this
    job's namespace, or else in the only namespace that has one (a job that called ``ray.init()``
    without a namespace runs in an anonymous one, which another driver cannot name).

    Raises:
        ValueError: no monitor of the run, there or anywhere.
        CheckpointConfigError: none in this job's namespace, and several namespaces have one.
    """
    import ray

    from ckptd.errors import CheckpointConfigError

    try:
        return ray.get_actor(actor_name(run), namespace=namespace)
    except ValueError:
        if namespace is not None:
            raise
    found = sorted({a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"] == actor_name(run)})
    if len(found) > 1:
        raise CheckpointConfigError(f"the monitor of run {run!r} exists in several Ray namespaces {found}, none of "
                                    "them this job's: pass namespace= to pick one")
    if not found:
        raise ValueError(f"no actor {actor_name(run)!r} in any namespace")
    return ray.get_actor(actor_name(run), namespace=found[0])


def attempt_id(attempt: int, root_url: str) -> str:
    """Which job a monitor serves, across roots: its attempt number on its root (a Ray restart of
    the same monitor keeps both) and a digest of the root. Attempt numbers alone repeat: the
    first job on every root is attempt 1, and two roots may host jobs of the same run name."""
    return f"{attempt}-{hashlib.sha256(root_url.encode()).hexdigest()[:12]}"


def describe_attempt(attempt_id: str) -> str:
    """How an error names an :func:`attempt_id`: ``attempt N`` (of a root known by its digest)."""
    number, _, digest = attempt_id.partition("-")
    return f"attempt {number} (of the root with digest {digest})"


def relay_name(run: str, attempt: str, where: str) -> str:
    """The Ray actor name of the notification relay of ``run``'s attempt (its :func:`attempt_id`) on one node (``where``
    is its node id) or of one zone (``zone{N}``), with ``node_relay=True``. A relay carries one
    attempt's reports only: a new job on the run starts its own."""
    return f"ckptd-relay-{run}-a{attempt}-{where}"


# -- ids -----------------------------------------------------------------------------------------

_seq = itertools.count()
_seq_lock = threading.Lock()
_process_nonce = uuid.uuid4().hex[:12]


def new_id() -> str:
    """A run-wide unique id for a unit call or a registration: this process's random nonce and a
    counter (hex digits and one '-', safe in file names)."""
    with _seq_lock:
        n = next(_seq)
    return f"{_process_nonce}-{n:x}"


@dataclass(frozen=True)
class UnitId:
    """One save unit: one ``save_async`` or ``save_sync`` call.

    ``worker``, ``name``, ``step`` and ``kind`` say what it is; ``call`` says which call it is
    (unique across the run), so repeated calls with the same name and step are distinct units.
    """

    worker: str
    name: str
    step: int
    kind: Kind
    call: str
    #: How the ledger names the unit: ``worker/name#call``, unique across the run (computed once:
    #: the monitor asks for it several times per notification).
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.worker}/{self.name}#{self.call}")

    @property
    def label(self) -> str:
        """How people name the unit: ``worker/name``."""
        return f"{self.worker}/{self.name}"

    def to_dict(self) -> dict:
        return {"worker": self.worker, "name": self.name, "step": self.step, "kind": self.kind.value,
                "call": self.call}

    @classmethod
    def from_dict(cls, d: dict) -> UnitId:
        return cls(d["worker"], d["name"], int(d["step"]), Kind(d["kind"]), d["call"])


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


class Registration(BaseModel):
    """One register call: unit counts to add per kind, and the kind it asks to be committed.

    Registrations of a step add up (Trinity's counters); ``reg_id`` makes a retried call count
    once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    reg_id: str
    step: int
    counts: dict[Kind, int]
    monitored: Kind
    at: float


# -- the ledger records in storage ---------------------------------------------------------------


def _dump(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def _write_record(storage: Storage, path: str, data: bytes, durable: bool = True) -> None:
    for tries in range(3):
        try:
            storage.write_atomic(path, data, durable=durable)
            return
        except FileNotFoundError:
            # The step's records directory was being removed (the clean-up after its commit, or
            # retention of an old step) between creating it and writing into it: write it again.
            if tries == 2:
                raise


def write_registration(storage: Storage, attempt: int, reg: Registration) -> None:
    _write_record(storage, f"{step_pending_dir(storage, attempt, reg.step)}/reg-{reg.reg_id}.json",
                  reg.model_dump_json().encode())


def _receipt_path(storage: Storage, attempt: int, unit: UnitId) -> str:
    return f"{step_pending_dir(storage, attempt, unit.step)}/unit-{unit.call}.json"


def write_started(storage: Storage, attempt: int, unit: UnitId) -> None:
    """Written before a unit asks to be admitted: a restarted monitor must know the units that are
    still writing (they hold their step's commit). Replaced by the unit's outcome."""
    body = {"unit": unit.to_dict(), "status": "started", "at": time.time()}
    _write_record(storage, _receipt_path(storage, attempt, unit), _dump(body), durable=False)


def restore_started(storage: Storage, attempt: int, unit: UnitId) -> bool:
    """Write the "started" receipt of ``unit`` if it has none (a retention deletion of its step
    removed the step's records while its report was on the way), never over one that is there:
    that may already say how the unit ended. True if it wrote one.

    POSIX: published with a hard link, which fails if the receipt exists. Elsewhere a check, then
    the write: a unit whose own receipt lands in between (a report that took longer than the
    unit) is overwritten; its next report replaces the receipt again.
    """
    path = _receipt_path(storage, attempt, unit)
    data = _dump({"unit": unit.to_dict(), "status": "started", "at": time.time()})
    if not storage.is_posix:
        if storage.exists(path):
            return False
        _write_record(storage, path, data, durable=False)
        return True
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.restore"
    with open(tmp, "wb") as f:
        f.write(data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def remove_receipt(storage: Storage, attempt: int, unit: UnitId) -> None:
    storage.rm(_receipt_path(storage, attempt, unit))


def write_finished(storage: Storage, attempt: int, unit: UnitId, files: list[FileEntry], found: bool = False) -> None:
    """A unit's receipt: its files, and whether they were found by time (save_fn returned None)."""
    body = {"unit": unit.to_dict(), "status": "finished", "at": time.time(),
            "files": [f.model_dump() for f in files], "found": found}
    # Not fsynced: a receipt lost to a power cut only means its step does not commit (it times
    # out, the safe direction); the commit itself is the monitor's fsynced manifest.
    _write_record(storage, _receipt_path(storage, attempt, unit), _dump(body), durable=False)


def write_failed(storage: Storage, attempt: int, unit: UnitId, failure: UnitFailure) -> None:
    """A failure receipt, durable: a restarted monitor must never commit the unit's step."""
    body = {"unit": unit.to_dict(), "status": "failed", "at": time.time(), "failure": failure.model_dump()}
    _write_record(storage, _receipt_path(storage, attempt, unit), _dump(body))


def write_step_failure(storage: Storage, attempt: int, step: int, kind: Kind, reason: str) -> None:
    body = _dump({"reason": reason, "at": time.time()})
    _write_record(storage, step_failure_path(storage, attempt, step, kind), body)


def write_step_deleted(storage: Storage, attempt: int, step: int, kinds: list[Kind]) -> None:
    """Retention deleted the step, whose ``kinds`` had committed: a step that also has a failed
    kind keeps its records (the failure must not be forgotten), and this says the committed
    kinds are not to be committed again. No kinds: a deletion marked, then not done."""
    path = f"{step_pending_dir(storage, attempt, step)}/deleted.json"
    _write_record(storage, path, _dump({"kinds": sorted(k.value for k in kinds), "at": time.time()}))


def remove_step_records(storage: Storage, attempt: int, step: int) -> None:
    storage.rm(step_pending_dir(storage, attempt, step))


@dataclass
class PendingStep:
    """What storage says about one step of one attempt."""

    step: int
    registrations: list[Registration] = field(default_factory=list)
    started: dict[UnitId, float] = field(default_factory=dict)  # admitted, no outcome yet
    finished: dict[UnitId, tuple[float, list[FileEntry], bool]] = field(default_factory=dict)
    failed: dict[UnitId, tuple[float, UnitFailure]] = field(default_factory=dict)
    failure_reasons: dict[Kind, str] = field(default_factory=dict)
    deleted_kinds: list[Kind] = field(default_factory=list)  # committed, then deleted by retention

    def first_seen(self) -> float | None:
        times = [f[0] for f in self.finished.values()] + [t for t, _ in self.failed.values()]
        times += list(self.started.values())
        times += [r.at for r in self.registrations]
        return min(times) if times else None


def pending_attempts(storage: Storage) -> list[int]:
    """The attempts that have ledger records under the root."""
    out = []
    for name in storage.listdir(pending_root(storage)):
        try:
            out.append(int(name))
        except ValueError:
            continue
    return sorted(out)


def recorded_steps(storage: Storage, attempt: int) -> set[int]:
    """The steps with ledger records of ``attempt``: every step a save unit of it was admitted into
    (its receipt is written before it writes) and that has not been settled since."""
    return {int(name) for name in storage.listdir(attempt_pending_dir(storage, attempt)) if name.isdigit()}


def load_pending(storage: Storage, attempt: int) -> Iterator[PendingStep]:
    """Every step with ledger records of ``attempt``, oldest step first."""
    for step in sorted(recorded_steps(storage, attempt)):
        yield load_step(storage, attempt, step)


def _read_json(storage: Storage, path: str) -> dict | None:
    try:
        text = storage.read_text_or_none(path)
        if text is None:
            return None
        return json.loads(text)
    except (json.JSONDecodeError, CorruptCheckpointError):
        # Records are published atomically, so this is damage from outside ckptd; skipping it
        # errs on the side of not committing.
        log.error("ignoring unreadable ledger record %s", path)
        return None


def load_step(storage: Storage, attempt: int, step: int) -> PendingStep:
    """The ledger records of ``attempt`` for ``step``."""
    d = step_pending_dir(storage, attempt, step)
    rec = PendingStep(step)
    for name in sorted(storage.listdir(d)):
        if not name.endswith(".json"):
            continue
        body = _read_json(storage, f"{d}/{name}")
        if body is None:
            continue
        if name == "deleted.json":
            rec.deleted_kinds = [Kind(k) for k in body["kinds"]]
        elif name.startswith("reg-"):
            rec.registrations.append(Registration.model_validate(body))
        elif name.startswith("failed-"):
            rec.failure_reasons[Kind(name[len("failed-"):-len(".json")])] = body["reason"]
        elif name.startswith("unit-"):
            unit = UnitId.from_dict(body["unit"])
            if body["status"] == "started":
                rec.started[unit] = float(body["at"])
            elif body["status"] == "finished":
                rec.finished[unit] = (float(body["at"]), [FileEntry(**f) for f in body["files"]],
                                      bool(body.get("found", False)))
            else:
                rec.failed[unit] = (float(body["at"]), UnitFailure(**body["failure"]))
    rec.registrations.sort(key=lambda r: r.at)
    return rec


# -- timing sent with notifications (for ``ckptd timeline``) ----------------------------------------

TIMING_KEY = "timing"
_OUTBOX_LIMIT = 10_000


class TimingOutbox:
    """What a coordinator measured and has not sent yet: unit spans and blocked intervals.

    The entries ride along with the next notification a unit sends (the ``"timing"`` key of a
    ``started`` or ``finished`` payload, which monitors that predate it ignore), or in a
    ``("timing", None, payload)`` notification at :meth:`~ckptd.CheckpointCoordinator.wait_all`
    when something is left. Thread-safe; bounded (the oldest entries go first), so a monitor that
    never reads them cannot make a worker grow.

    Timestamps are ``time.time()`` of the worker's process: on several nodes, the timeline is as
    good as their clocks' agreement.
    """

    def __init__(self, limit: int = _OUTBOX_LIMIT) -> None:
        self._lock = threading.Lock()
        self._units: deque[dict] = deque(maxlen=limit)
        self._blocked: deque[dict] = deque(maxlen=limit)
        self._amended: deque[dict] = deque(maxlen=limit)

    def unit(self, unit: UnitId, start: float, admitted: float | None, end: float, error: str | None = None,
             phases: dict[str, float] | None = None) -> None:
        """A unit ran from ``start`` (it asked to be admitted) through ``admitted`` (its save
        function started) to ``end`` (its receipt was written, or it failed with ``error``);
        ``phases``: seconds per phase of its save (:mod:`ckptd.phases`)."""
        entry = {"unit": unit.to_dict(), "start": start, "admitted": admitted, "end": end, "error": error}
        if phases:
            entry["phases"] = dict(phases)
        with self._lock:
            self._units.append(entry)

    def amend(self, unit: UnitId, start: float, phases: dict[str, float]) -> None:
        """Phases of a unit whose span (the one that started at ``start``) was already sent:
        the monitor adds them to it (monitors that predate this ignore them)."""
        entry = {"unit": unit.to_dict(), "start": start, "phases": dict(phases)}
        with self._lock:
            self._amended.append(entry)

    def blocked(self, worker: str, step: int, start: float, end: float, what: str) -> None:
        """The training thread spent ``start``..``end`` inside ``what`` (a save call, the fence)."""
        entry = {"worker": worker, "step": step, "start": start, "end": end, "what": what}
        with self._lock:
            self._blocked.append(entry)

    def drain(self) -> dict | None:
        """Everything not sent yet, as a payload value (None if nothing)."""
        with self._lock:
            if not self._units and not self._blocked and not self._amended:
                return None
            out = {"units": list(self._units), "blocked": list(self._blocked)}
            if self._amended:
                out["amended"] = list(self._amended)
            self._units.clear()
            self._blocked.clear()
            self._amended.clear()
        return out


def timing_of(payload: object) -> dict | None:
    """The timing a notification payload carries, if any (payloads of older coordinators have none)."""
    if isinstance(payload, dict):
        timing = payload.get(TIMING_KEY)
        if isinstance(timing, dict):
            return timing
    return None


def default_worker_id(node_id: str, actor_id: str | None) -> str:
    """A worker id unique to one coordinator: where it runs, plus a counter of this process."""
    where = f"actor-{actor_id[:16]}" if actor_id else f"{node_id[:12]}-pid{os.getpid()}"
    return f"{where}-c{new_id().rsplit('-', 1)[1]}"
