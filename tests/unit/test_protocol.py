"""The records coordinators and the monitor share (real files, no Ray)."""

from __future__ import annotations

import os
import uuid

import pytest

from ckptd import protocol
from ckptd.config import Kind
from ckptd.manifest import FileEntry
from ckptd.protocol import Registration, UnitFailure, UnitId
from ckptd.storage import Storage


def _unit(worker: str, name: str, step: int = 1) -> UnitId:
    return UnitId(worker, name, step, Kind.CHECKPOINT, protocol.new_id())


def test_receipts_of_different_units_never_collide(tmp_path):
    storage = Storage(str(tmp_path))
    a, b = _unit("a~b", "c"), _unit("a", "b~c")  # one file name under the old worker~name scheme
    protocol.write_finished(storage, 1, a, [FileEntry(path="x", size=1, crc32="0")])
    protocol.write_failed(storage, 1, b, UnitFailure(unit=b.label, error_type="OSError", message="m"))
    (pending,) = protocol.load_pending(storage, 1)
    assert set(pending.finished) == {a} and set(pending.failed) == {b}


def test_a_retry_of_a_failed_save_never_overwrites_its_failure(tmp_path):
    storage = Storage(str(tmp_path))
    first, retry = _unit("w", "model"), _unit("w", "model")  # same worker, name and step: two calls
    protocol.write_failed(storage, 1, first, UnitFailure(unit=first.label, error_type="OSError", message="m"))
    protocol.write_finished(storage, 1, retry, [])
    (pending,) = protocol.load_pending(storage, 1)
    assert set(pending.failed) == {first} and set(pending.finished) == {retry}


def test_records_belong_to_their_attempt(tmp_path):
    storage = Storage(str(tmp_path))
    reg = Registration(reg_id=protocol.new_id(), step=3, counts={Kind.CHECKPOINT: 2}, monitored=Kind.CHECKPOINT, at=1.0)
    protocol.write_registration(storage, 1, reg)
    protocol.write_step_failure(storage, 1, 3, Kind.CHECKPOINT, "timed out")
    assert list(protocol.load_pending(storage, 2)) == []
    (pending,) = protocol.load_pending(storage, 1)
    assert pending.registrations == [reg] and pending.failure_reasons == {Kind.CHECKPOINT: "timed out"}
    assert protocol.pending_attempts(storage) == [1]


def test_ids_and_default_worker_ids_are_unique():
    assert len({protocol.new_id() for _ in range(1000)}) == 1000
    assert protocol.default_worker_id("n" * 20, None) != protocol.default_worker_id("n" * 20, None)


class _CleanedUnderneath(Storage):
    """A root whose step records directory is removed once, between being created and the record
    being renamed into it: the clean-up of a step that just committed, racing a worker's receipt."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.removed = 0

    def write_atomic(self, path, data, *, before_publish=None, durable=True):
        def remove_once():
            if not self.removed:
                self.removed += 1
                protocol.remove_step_records(self, 1, 1)

        super().write_atomic(path, data, before_publish=remove_once, durable=durable)


def test_a_record_written_while_its_step_is_cleaned_up_is_written_again(tmp_path):
    a, b = _unit("w", "model"), _unit("w", "sd")
    for write in (lambda s: protocol.write_started(s, 1, a),
                  lambda s: protocol.write_finished(s, 1, a, []),
                  lambda s: protocol.write_failed(s, 1, b, UnitFailure(unit=b.label, error_type="E", message="m")),
                  lambda s: protocol.write_step_failure(s, 1, 1, Kind.CHECKPOINT, "timed out")):
        storage = _CleanedUnderneath(str(tmp_path / protocol.new_id()))
        write(storage)
        assert storage.removed == 1
        (pending,) = protocol.load_pending(storage, 1)
        assert pending.started or pending.finished or pending.failed or pending.failure_reasons


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_restored_started_receipt_never_replaces_one_that_is_there(tmp_path, where):
    """The monitor writes a "started" receipt again only where a retention deletion removed it:
    a late report must never turn a finished (or failed) unit back into a running one."""
    storage = Storage(str(tmp_path / "root") if where == "local" else f"memory://protocol-{uuid.uuid4().hex[:8]}/r")
    done, gone = _unit("w", "optim"), _unit("w", "model")
    protocol.write_finished(storage, 1, done, [FileEntry(path="x", size=1, crc32="0")])
    assert protocol.restore_started(storage, 1, done) is False
    assert protocol.restore_started(storage, 1, gone) is True
    assert protocol.restore_started(storage, 1, gone) is False  # there now: left as it is
    (pending,) = protocol.load_pending(storage, 1)
    assert set(pending.finished) == {done} and set(pending.started) == {gone}
    if where == "local":  # no temporary file left behind
        names = os.listdir(os.path.dirname(protocol._receipt_path(storage, 1, gone)))
        assert sorted(names) == sorted(f"unit-{u.call}.json" for u in (done, gone))
