"""Per-phase timings of a save (ckptd.phases) and how they reach the timeline (spans, amendments)."""

from __future__ import annotations

import threading
import time

from ckptd import phases, protocol
from ckptd.config import Kind
from ckptd.monitor.event_store import EventStore, read_events
from ckptd.monitor.events import (
    UNIT,
    EventLog,
    Span,
    amendments_from_timing,
    spans_from_timing,
)
from ckptd.storage import Storage


def _spin(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def test_nested_phases_count_once_for_the_inner_phase():
    with phases.collect() as times:
        with phases.phase("write"):
            _spin(0.02)
            with phases.phase("fsync"):
                _spin(0.2)
        with phases.phase("write"):  # a second file adds up
            _spin(0.01)
        phases.add("staging", 0.5)
    assert set(times) == {"write", "fsync", "staging"}
    assert times["fsync"] >= 0.2
    assert 0.03 <= times["write"] < 0.15  # 0.02 + 0.01: the fsync (0.2) is not counted twice
    assert times["staging"] == 0.5


def test_phases_outside_collect_are_not_recorded_and_threads_keep_their_own():
    with phases.phase("write"):  # no accumulator: a writer used from user code
        phases.add("staging", 1.0)
    other: dict = {}

    def worker() -> None:
        with phases.collect() as t:
            with phases.phase("checksum"):
                _spin(0.01)
        other.update(t)

    with phases.collect() as mine:
        th = threading.Thread(target=worker)
        th.start()
        th.join()
        with phases.phase("receipt"):
            pass
        with phases.collect() as inner:  # an inner collect keeps its totals apart
            with phases.phase("write"):
                pass
    assert set(other) == {"checksum"} and other["checksum"] > 0
    assert set(mine) == {"receipt"} and set(inner) == {"write"}


def test_outbox_carries_phases_and_amendments_to_the_span():
    box = protocol.TimingOutbox()
    unit = protocol.UnitId("w", "model", 3, Kind.CHECKPOINT, "c1")
    box.unit(unit, 10.0, 10.1, 11.0, phases={"write": 0.5, "fsync": 0.2})
    first = box.drain()
    assert "amended" not in first  # payloads without amendments keep their old shape
    box.amend(unit, 10.0, {"notification": 0.003})
    second = box.drain()
    assert second["units"] == [] and len(second["amended"]) == 1

    log = EventLog()
    log.add(spans_from_timing(first, attempt=1))
    assert log.spans()[0].phases == {"write": 0.5, "fsync": 0.2}
    log.take_unflushed()  # the span was persisted before its amendment came
    log.amend(amendments_from_timing(second))
    span = log.spans()[0]
    assert span.phases == {"write": 0.5, "fsync": 0.2, "notification": 0.003}
    assert log.take_unflushed() == [span]  # persisted again, amended


def test_bad_phases_are_dropped_without_losing_the_span():
    unit = {"worker": "w", "name": "m", "step": 1, "kind": "checkpoint", "call": "c"}
    timing = {"units": [{"unit": unit, "start": 1.0, "end": 2.0,
                         "phases": {"write": "fast", "fsync": float("nan"), "receipt": -1, "staging": 0.25}}],
              "amended": [{"unit": unit, "start": 1.0, "phases": "soon"}, "junk", {"unit": None}]}
    spans = spans_from_timing(timing)
    assert len(spans) == 1 and spans[0].phases == {"staging": 0.25}
    assert amendments_from_timing(timing) == []
    assert spans_from_timing({"units": [{"unit": unit, "start": 1.0, "end": 2.0, "phases": [1]}]})[0].phases is None


def test_readers_keep_the_later_record_of_an_amended_span(tmp_path):
    storage = Storage(str(tmp_path))
    store = EventStore(storage, "run")
    span = Span(UNIT, 1, 5.0, 6.0, worker="w", name="m", kind="checkpoint", phases={"write": 0.4})
    store.write([span], [span])
    amended = Span(UNIT, 1, 5.0, 6.0, worker="w", name="m", kind="checkpoint",
                   phases={"write": 0.4, "notification": 0.01})
    store.write([amended], [amended])
    [read] = read_events(storage, "run")
    assert read.phases == {"write": 0.4, "notification": 0.01}
    assert Span.from_dict(read.to_dict()).phases == read.phases
