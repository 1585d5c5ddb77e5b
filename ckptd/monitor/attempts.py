"""Attempts: every job that starts a monitor on a root opens a new generation, and only the newest
may publish manifests and trackers.

    root/.ckptd/attempts/{n}.json       the attempt record, created exclusively by start_monitor
    root/.ckptd/attempts/{n}.started    written by the monitor once it has cleaned up after the
                                        attempts before it (a Ray restart of the same monitor
                                        finds it and adopts its own records instead)

A Ray restart of the same monitor keeps its attempt (the number is an argument of the actor).
A new job gets a new number, discards the records of every older attempt, and clears the files
those attempts left in steps they never committed, so those steps start clean. A monitor whose
attempt is no longer the newest is fenced: :func:`ckptd.fencing.check_fence` runs before every
publish, the monitor's and the save units'.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from ckptd import failpoints
from ckptd.commit import fsync_path, temp_name
from ckptd.config import Kind
from ckptd.errors import CheckpointError
from ckptd.fencing import AttemptRecord, attempts_dir, list_attempts
from ckptd.layout import MANIFESTS, foreign_dirs, listed_files, scan_steps
from ckptd.manifest import changed_files, is_internal, read_manifest
from ckptd.monitor.start_checks import state_dicts_in_flight, withdrawals_cut_short
from ckptd.protocol import attempt_pending_dir, pending_attempts, recorded_steps
from ckptd.storage import Storage
from ckptd.template import StepDirTemplate

log = logging.getLogger("ckptd.monitor")


def open_attempt(storage: Storage, run: str, namespace: str | None) -> AttemptRecord:
    """Create the next attempt's record; exactly one of two concurrent callers gets a number.

    POSIX: a hard link, which fails if the name exists. Object stores: the record is written, then
    read back, and the call retries with the next number if another writer won.
    """
    for _ in range(100):
        attempts = list_attempts(storage)
        rec = AttemptRecord(attempt=(attempts[-1] + 1) if attempts else 1, run=run, namespace=namespace,
                            root=storage.url, started_at=time.time(), host=socket.gethostname())
        path = f"{attempts_dir(storage)}/{rec.attempt}.json"
        data = rec.model_dump_json().encode()
        if storage.is_posix:
            os.makedirs(attempts_dir(storage), exist_ok=True)
            tmp = temp_name(path)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                continue
            finally:
                os.unlink(tmp)
            fsync_path(attempts_dir(storage))
            return _without_stale_start(storage, rec)
        if storage.exists(path):
            continue
        storage.write_atomic(path, data)
        if storage.read_bytes(path) == data:
            return _without_stale_start(storage, rec)
    raise CheckpointError(f"could not open a new attempt under {storage.url}: too many concurrent starts")


def _without_stale_start(storage: Storage, rec: AttemptRecord) -> AttemptRecord:
    """Remove a start marker of the number just claimed: no monitor of this attempt ran yet, so it
    is the marker of a start taken back (a start_monitor that lost, whose actor marked its start
    as it was being killed). Left there, this attempt's monitor would take its first start for a
    Ray restart and skip its clean-up of the older attempts."""
    storage.rm(f"{attempts_dir(storage)}/{rec.attempt}.started")
    return rec


def started_before(storage: Storage, attempt: int) -> bool:
    """Whether a monitor of ``attempt`` already started once (this start is a Ray restart)."""
    return storage.exists(f"{attempts_dir(storage)}/{attempt}.started")


def mark_started(storage: Storage, attempt: int) -> None:
    storage.write_atomic(f"{attempts_dir(storage)}/{attempt}.started", json.dumps({"at": time.time()}).encode())


def clean_up_older_attempts(storage: Storage, attempt: int, template: StepDirTemplate) -> list[str]:
    """Discard the ledger records of older attempts, and remove the files they left in steps they
    did not commit as checkpoints. Returns what was removed.

    Only steps an older attempt of ckptd touched are cleaned: steps with its ledger records, and
    steps with a committed state dict (whose files outside that manifest go). Committed files are
    never touched, and neither are step directories ckptd has no trace of, nor those the root held
    before ckptd first used it (another tool's: :func:`ckptd.layout.foreign_dirs`), even where an
    older attempt left records of a refused save or a registration for their step numbers. The
    exceptions: a state dict committed in a step an older attempt was still saving into
    (:func:`~ckptd.monitor.start_checks.state_dicts_in_flight`), whose
    listed files storage no longer holds (a unit replaced one, and its monitor did not live to
    withdraw the state dict), and one whose withdrawal an older attempt began and did not end
    (:func:`~ckptd.monitor.start_checks.withdrawals_cut_short`), are not committed any more:
    the manifest goes, and the step is cleaned as uncommitted.
    """
    removed = []
    touched: set[int] = set()
    older = [other for other in pending_attempts(storage) if other < attempt]
    for other in older:
        touched |= recorded_steps(storage, other)
    foreign = foreign_dirs(storage) or set()
    scanned = scan_steps(storage, template)
    saving_into = state_dicts_in_flight(storage, scanned, older)
    cut_short = withdrawals_cut_short(storage, scanned, older)
    for step, entry in sorted(scanned.items()):
        if Kind.CHECKPOINT in entry.kinds or not (entry.kinds or step in touched) or entry.name in foreign:
            continue
        path = storage.join(entry.name)
        why = ("its withdrawal was cut short" if step in cut_short else
               "a file it lists changed" if step in saving_into and _stale_state_dict(storage, entry.name) else None)
        if why is not None:
            storage.rm(f"{path}/{MANIFESTS[Kind.STATE_DICT]}")
            removed.append(f"{entry.name}/{MANIFESTS[Kind.STATE_DICT]} ({why})")
            entry = type(entry)(entry.step, entry.name, frozenset())
        if not entry.kinds:
            storage.rm(path)
            removed.append(entry.name)
            continue
        listed = listed_files(storage, entry)
        for rel in storage.walk_files(path):
            if rel not in listed and not is_internal(rel):
                storage.rm(f"{path}/{rel}")
                removed.append(f"{entry.name}/{rel}")
    # Last: a state dict withdrawn above stayed out of the readers' answers by its failure record
    # until its manifest went (see ckptd.layout.newest_committed).
    failpoints.hit("before_discarding_older_records")
    for other in older:
        storage.rm(attempt_pending_dir(storage, other))
        removed.append(f"ledger records of attempt {other}")
    if removed:
        log.warning("attempt %d: removed what older attempts left uncommitted: %s", attempt, ", ".join(removed))
    return removed


def _stale_state_dict(storage: Storage, name: str) -> bool:
    """Whether step directory ``name`` has a state-dict manifest listing bytes storage no longer holds."""
    manifest = read_manifest(storage, storage.join(name, MANIFESTS[Kind.STATE_DICT]))
    return manifest is not None and bool(changed_files(storage, name, manifest.files))
