"""Adversarial inputs to the timeline's event store (no Ray): workers' timing payloads that are
malformed in ways the monitor cannot refuse (they ride along with real notifications), and chunk
files damaged on storage before a monitor reads them back."""

from __future__ import annotations

import json
import os

from ckptd.monitor.events import EVENTS_DIR, EventLog, EventStore, Span, read_events, spans_from_timing
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
