"""The attempt records that fence an older job's monitor out of a root (``ckptd.fencing``)."""

from __future__ import annotations

import threading

from ckptd.fencing import attempts_dir, current_attempt
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
    finally:
        stop.set()
        thread.join()
    assert None not in seen and seen <= {2, 3}, seen
