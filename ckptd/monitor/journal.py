"""The durable side of the ledger: registrations, unit receipts and step failures in storage.

Workers write their own unit receipts from the save thread, before they notify the monitor, so
the monitor does no I/O per notification and a restarted monitor can rebuild every step that was
in flight from storage alone. The monitor writes registrations (before it acknowledges them) and
step failures. Everything is small JSON, published with :meth:`Storage.write_atomic`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ckptd.config import Kind
from ckptd.layout import parse_pending_name, pending_dir, pending_root
from ckptd.manifest import FileEntry
from ckptd.monitor.ledger import UnitFailure
from ckptd.storage import Storage
from ckptd.units import UnitId

log = logging.getLogger(__name__)


def _dump(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def write_registration(storage: Storage, step: int, kind: Kind, count: int, at: float) -> None:
    path = f"{pending_dir(storage, step, kind)}/registration.json"
    storage.write_atomic(path, _dump({"step": step, "kind": kind.value, "count": count, "at": at}))


def write_finished(storage: Storage, unit: UnitId, files: list[FileEntry]) -> None:
    body = {"unit": unit.to_dict(), "status": "finished", "at": time.time(),
            "files": [f.model_dump() for f in files]}
    # Not fsynced: a receipt lost to a power cut only means its step does not commit (it times
    # out, the safe direction); the commit itself is the monitor's fsynced manifest.
    storage.write_atomic(_receipt_path(storage, unit), _dump(body), durable=False)


def write_failed(storage: Storage, unit: UnitId, failure: UnitFailure) -> None:
    body = {"unit": unit.to_dict(), "status": "failed", "at": time.time(),
            "failure": failure.model_dump()}
    storage.write_atomic(_receipt_path(storage, unit), _dump(body))


def write_step_failure(storage: Storage, step: int, kind: Kind, reason: str) -> None:
    path = f"{pending_dir(storage, step, kind)}/failed.json"
    storage.write_atomic(path, _dump({"reason": reason, "at": time.time()}))


def remove_pending(storage: Storage, step: int, kind: Kind) -> None:
    storage.rm(pending_dir(storage, step, kind))


def _receipt_path(storage: Storage, unit: UnitId) -> str:
    return f"{pending_dir(storage, unit.step, unit.kind)}/units/{unit.file_stem}.json"


@dataclass
class PendingStep:
    """What storage says about one (step, kind) that has no manifest yet."""

    step: int
    kind: Kind
    count: int | None = None
    registered_at: float | None = None
    finished: dict[UnitId, tuple[float, list[FileEntry]]] = field(default_factory=dict)
    failed: dict[UnitId, tuple[float, UnitFailure]] = field(default_factory=dict)
    failure_reason: str | None = None

    def first_seen(self) -> float | None:
        times = [t for t, _ in self.finished.values()] + [t for t, _ in self.failed.values()]
        if self.registered_at is not None:
            times.append(self.registered_at)
        return min(times) if times else None


def load_pending(storage: Storage) -> Iterator[PendingStep]:
    """Every (step, kind) with ledger records in storage, oldest step first."""
    found = (parse_pending_name(name) for name in storage.listdir(pending_root(storage)))
    for step, kind in sorted(key for key in found if key is not None):
        yield _load_one(storage, step, kind)


def _read_json(storage: Storage, path: str) -> dict | None:
    text = storage.read_text_or_none(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # Records are published atomically, so this is damage from outside ckptd; skipping it
        # errs on the side of not committing.
        log.error("ignoring unreadable ledger record %s", path)
        return None


def _load_one(storage: Storage, step: int, kind: Kind) -> PendingStep:
    d = pending_dir(storage, step, kind)
    rec = PendingStep(step, kind)
    reg = _read_json(storage, f"{d}/registration.json")
    if reg is not None:
        rec.count, rec.registered_at = int(reg["count"]), float(reg["at"])
    failed = _read_json(storage, f"{d}/failed.json")
    if failed is not None:
        rec.failure_reason = failed["reason"]
    for name in storage.listdir(f"{d}/units"):
        if not name.endswith(".json"):
            continue
        body = _read_json(storage, f"{d}/units/{name}")
        if body is None:
            continue
        unit = UnitId.from_dict(body["unit"])
        if body["status"] == "finished":
            rec.finished[unit] = (float(body["at"]), [FileEntry(**f) for f in body["files"]])
        else:
            rec.failed[unit] = (float(body["at"]), UnitFailure(**body["failure"]))
    return rec
