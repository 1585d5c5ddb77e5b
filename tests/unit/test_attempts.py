"""The attempt records that fence an older job's monitor out of a root (``ckptd.fencing``)."""

from __future__ import annotations

import threading

import pytest

from ckptd.fencing import FencedError, attempts_dir, check_fence, current_attempt, newer_attempts
from ckptd.monitor.attempts import open_attempt
from ckptd.storage import Storage


def test_the_current_attempt_skips_one_taken_back_between_the_listing_and_the_read(tmp_path):
    """Attempt 2 (a newer job) stays; attempt 3 is opened and taken back over and over, as losing
    ``start_monitor`` calls do. Whenever a look lists attempt 3 and then finds it gone, it must
    answer attempt 2, not "no attempt": a monitor of attempt 1 would lift its fence on that answer
    while attempt 2 owns the root. Found by a helper's attack (session 33)."""
    storage = Storage(str(tmp_path / "root"))
    open_attempt(storage, "old-job", None)
    newer = open_attempt(storage, "newer-job", None)
    record = storage.read_bytes(f"{attempts_dir(storage)}/{newer.attempt}.json")
    path = f"{attempts_dir(storage)}/3.json"
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            storage.write_atomic(path, record.replace(b'"attempt":2', b'"attempt":3'))  # as open_attempt
            storage.rm(path)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        seen = {getattr(current_attempt(storage), "attempt", None) for _ in range(2000)}
        newer = {tuple(r.attempt for r in newer_attempts(storage, 1)) for _ in range(2000)}
    finally:
        stop.set()
        thread.join()
    assert None not in seen and seen <= {2, 3}, seen
    assert newer <= {(2,), (2, 3)}, newer  # what the fence watch reads: attempt 2 every time


def test_a_newer_attempt_whose_record_does_not_parse_still_fences(tmp_path):
    """A torn or foreign record of attempt 2 still means someone opened attempt 2: a publish of
    attempt 1 is refused with FencedError (not a parse error, which the monitor would not count
    as a fence), and the fence watch sees the same record at every look, so the fence becomes
    final instead of every look failing."""
    storage = Storage(str(tmp_path / "root"))
    mine = open_attempt(storage, "old-job", None).attempt
    storage.write_atomic(f"{attempts_dir(storage)}/2.json", b'{"attempt": 2, "run"')
    with pytest.raises(FencedError, match="superseded by attempt 2"):
        check_fence(storage, mine)
    first, second = newer_attempts(storage, mine), newer_attempts(storage, mine)
    assert [r.attempt for r in first] == [2] and first == second


def test_a_start_marker_left_by_a_start_taken_back_does_not_pass_for_the_next_jobs(tmp_path):
    """A losing start_monitor takes its attempt back, but its actor, being killed, may still mark
    its start: the next job claims the same number, and its monitor took its first start for a Ray
    restart and skipped the clean-up of older attempts (helper-67's edge)."""
    from ckptd.monitor.attempts import mark_started, started_before

    storage = Storage(str(tmp_path / "root"))
    mark_started(storage, open_attempt(storage, "old-job", None).attempt)
    mark_started(storage, 2)  # the marker of attempt 2, whose record was taken back
    rec = open_attempt(storage, "next-job", None)
    assert rec.attempt == 2 and not started_before(storage, 2)
