"""Adversarial inputs to the timeline's event store (no Ray): workers' timing payloads that are
malformed in ways the monitor cannot refuse (they ride along with real notifications), and chunk
files damaged on storage before a monitor reads them back."""

from __future__ import annotations

import json
import os

from ckptd.monitor.event_store import EVENTS_DIR, EventStore, read_events
from ckptd.monitor.events import EventLog, Span, spans_from_timing
from ckptd.storage import Storage


def _unit(step: int, **over) -> dict:
    entry = {"unit": {"worker": "w0", "name": "model", "step": step, "kind": "checkpoint", "call": "c"},
             "start": 1.0, "admitted": 1.5, "end": 2.0, "error": None}
    entry.update(over)
    return entry


def test_a_timing_entry_that_is_not_json_writable_does_not_poison_every_later_flush(tmp_path):
    # A worker's error is whatever its outbox held: an exception object, bytes... Kept as is, the
    # span made every later write of the event store fail (its batch is given back each time),
    # so nothing of the run was persisted again.
    storage = Storage(str(tmp_path))
    spans = spans_from_timing({"units": [_unit(1, error=OSError("disk")), _unit(2, error=b"\xff"),
                                         _unit(float("inf")), _unit(4)],
                               "blocked": [{"worker": "w0", "step": float("nan"), "start": 0, "end": 1}]})
    assert sorted(s.step for s in spans) == [1, 2, 4]  # the overflowing/NaN steps skipped, not the batch
    log, store = EventLog(), EventStore(storage, "run")
    log.add(spans)
    store.write(log.take_unflushed(), log.spans())
    back = read_events(storage, "run")
    assert [(s.step, s.error) for s in back] == [(1, "disk"), (2, "b'\\xff'"), (4, None)]


def test_damaged_timeline_files_are_skipped_and_the_rest_still_read(tmp_path):
    storage = Storage(str(tmp_path))
    store = EventStore(storage, "run")
    for step in (1, 2):
        store.write([Span("commit", step, 1.0, 2.0)], [])
    directory = os.path.join(str(tmp_path), EVENTS_DIR, "run")
    good = sorted(os.listdir(directory))
    # Damage from outside ckptd, each named so that it sorts between or after the good chunks:
    # valid JSON that is not an object, bytes that are not UTF-8, a truncated file, bad spans.
    damaged = {"[1, 2]": good[0][:-7] + "a-c.json", b"\xff\xfe\x00": good[1][:-7] + "b-c.json",
               '{"format": 1, "spans": [{"lane": "un': "9999999999999-x-000001-c.json",
               json.dumps({"format": 1, "spans": ["x", 3]}): "9999999999999-x-000002-c.json"}
    for body, name in damaged.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(body if isinstance(body, bytes) else body.encode())
    assert [s.step for s in read_events(storage, "run")] == [1, 2]


def test_a_snapshot_left_by_a_monitor_whose_clock_ran_ahead_does_not_hide_what_follows(tmp_path):
    # The run's previous monitor ran on a node whose clock was ahead: its snapshot's name sorts
    # after everything this monitor writes by its own clock, so readers took it as the newest and
    # ignored every later chunk and snapshot (a restarted monitor lost them).
    storage = Storage(str(tmp_path))
    directory = os.path.join(str(tmp_path), EVENTS_DIR, "run")
    os.makedirs(directory)
    body = {"format": 1, "run": "run", "snapshot": True, "spans": [Span("commit", 1, 1.0, 2.0).to_dict()]}
    with open(os.path.join(directory, "9999999999000-aaaaaaaa-000001-s.json"), "w") as f:
        json.dump(body, f)
    store = EventStore(storage, "run", max_chunks=2)
    log = EventLog()
    log.add(read_events(storage, "run"), flushed=True)
    for step in (2, 3, 4):  # two chunks, then a snapshot
        log.add([Span("commit", step, 1.0, 2.0)])
        store.write(log.take_unflushed(), log.spans())
    assert [s.step for s in read_events(storage, "run")] == [1, 2, 3, 4]
    assert "9999999999000-aaaaaaaa-000001-s.json" not in os.listdir(directory)  # superseded, removed
