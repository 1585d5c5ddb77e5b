"""The ledger records in storage: the two kinds of a step are written and removed independently."""

from __future__ import annotations

import os
import threading

from ckptd.config import Kind
from ckptd.layout import pending_dir, pending_root
from ckptd.manifest import FileEntry
from ckptd.monitor import journal
from ckptd.storage import Storage
from ckptd.units import UnitId

CK, SD = Kind.CHECKPOINT, Kind.STATE_DICT


def test_records_of_both_kinds_load_back_oldest_step_first_and_foreign_entries_are_ignored(tmp_path):
    storage = Storage(str(tmp_path))
    journal.write_registration(storage, 10, CK, 2, 5.0)
    journal.write_registration(storage, 9, SD, 1, 4.0)
    unit = UnitId("w0", "optim", 10, CK)
    journal.write_finished(storage, unit, [FileEntry(path="optim.bin", size=3, crc32="00000000")])
    journal.write_step_failure(storage, 9, SD, "timed out")
    for junk in ("10", "x.checkpoint", "10.weights", "notes.txt"):
        os.makedirs(f"{pending_root(storage)}/{junk}")

    loaded = list(journal.load_pending(storage))

    assert [(r.step, r.kind) for r in loaded] == [(9, SD), (10, CK)]
    assert loaded[0].failure_reason == "timed out" and loaded[0].count == 1
    assert loaded[1].count == 2 and loaded[1].registered_at == 5.0
    assert loaded[1].finished[unit][1][0].path == "optim.bin"


def test_removing_one_kind_keeps_the_directory_the_other_kind_is_written_into(tmp_path):
    # A full step has both kinds. Its state dict can commit (and its records go) at the moment
    # the checkpoint kind registers: whatever the checkpoint's writes create first must not be
    # removed with the state dict's records, or they fail with FileNotFoundError (seen in CI).
    storage = Storage(str(tmp_path))
    journal.write_registration(storage, 7, SD, 1, 0.0)
    sibling = os.path.dirname(pending_dir(storage, 7, CK))
    os.makedirs(sibling, exist_ok=True)  # as far as the checkpoint's makedirs may have got

    journal.remove_pending(storage, 7, SD)

    assert not os.path.exists(pending_dir(storage, 7, SD))
    assert os.path.isdir(sibling)


def test_concurrent_registration_and_removal_of_the_two_kinds_never_fails(tmp_path):
    storage = Storage(str(tmp_path))
    steps = range(300)
    errors: list[BaseException] = []
    turn = threading.Barrier(2)

    def register_checkpoints():
        for step in steps:
            turn.wait()
            try:
                journal.write_registration(storage, step, CK, 1, 0.0)
            except OSError as e:
                errors.append(e)

    def commit_state_dicts():
        for step in steps:
            journal.write_registration(storage, step, SD, 1, 0.0)
            turn.wait()
            journal.remove_pending(storage, step, SD)

    threads = [threading.Thread(target=register_checkpoints), threading.Thread(target=commit_state_dicts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [(r.step, r.kind) for r in journal.load_pending(storage)] == [(s, CK) for s in steps]
