"""The timeline's plain-Python parts: the bounded event log, its persistence under a root (real
files), the recorder's failure handling, the timing workers send, and the layout."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from ckptd import protocol
from ckptd.config import Kind, MonitorOptions
from ckptd.errors import CheckpointConfigError
from ckptd.monitor.event_store import EVENTS_DIR, EventStore, read_events, runs_with_events
from ckptd.monitor.events import (
    BLOCKED,
    COMMIT,
    MIRROR,
    UNIT,
    EventLog,
    Span,
    spans_from_timing,
)
from ckptd.monitor.recorder import Recorder
from ckptd.storage import Storage
from ckptd.timeline.html import render_html
from ckptd.timeline.layout import build_layout


def unit_span(step: int, worker: str = "rank0", name: str = "model", start: float = 100.0, **kw) -> Span:
    return Span(UNIT, step, start, start + 1.0, worker=worker, name=name, kind="checkpoint", admitted=start + 0.25,
                **kw)


def in_thread(fn, *args):
    async def run():
        return fn(*args)
    return run()


# -- the in-memory log ---------------------------------------------------------------------------


def test_log_drops_the_oldest_steps_first():
    log = EventLog(max_steps=3)
    log.add([unit_span(s, start=100.0 + s) for s in (5, 1, 4, 2, 3)])
    assert log.steps() == [3, 4, 5]
    assert log.dropped_steps == 2
    log.add([unit_span(1)])  # older than everything kept in a full log: not kept
    assert log.steps() == [3, 4, 5]
    log.add([unit_span(3, worker="rank1")])  # a kept step takes more spans
    assert [s.step for s in log.spans()] == [3, 3, 4, 5]
    assert sorted(s.step for s in log.take_unflushed()) == [3, 3, 4, 5]  # dropped steps are not persisted
    log.add([unit_span(6)])
    assert log.steps() == [4, 5, 6] and [s.step for s in log.take_unflushed()] == [6]


def test_log_bounds_its_spans_but_keeps_the_newest_step_whole():
    log = EventLog(max_steps=100, max_spans=10)
    log.add([unit_span(1, name=f"n{i}") for i in range(6)])
    log.add([unit_span(2, name=f"n{i}") for i in range(6)])
    assert log.steps() == [2]
    log.add([unit_span(3, name=f"n{i}") for i in range(12)])  # one step past the bound: kept whole
    assert log.steps() == [3] and len(log.spans()) == 12
    with pytest.raises(ValueError, match="max_steps"):
        EventLog(max_steps=0)


def test_spans_given_back_after_a_failed_write_are_written_next_unless_dropped():
    log = EventLog(max_steps=2)
    log.add([unit_span(1), unit_span(2)])
    taken = log.take_unflushed()
    assert log.take_unflushed() == []
    log.add([unit_span(3)])  # drops step 1 meanwhile
    log.give_back(taken)
    assert sorted(s.step for s in log.take_unflushed()) == [2, 3]


# -- persistence ---------------------------------------------------------------------------------


def test_chunks_then_a_snapshot_that_supersedes_them(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    log = EventLog()
    store = EventStore(storage, "run-a", max_chunks=3)
    written = []
    for step in range(1, 6):
        new = [unit_span(step, start=100.0 + step), Span(COMMIT, step, 102.0 + step, 102.5 + step, name="checkpoint")]
        log.add(new)
        store.write(log.take_unflushed(), log.spans())
        written += new
    files = sorted(os.listdir(tmp_path / "root" / EVENTS_DIR / "run-a"))
    # Three chunks, then a snapshot of everything (the chunks before it deleted), then a chunk.
    assert [f[-6:] for f in files] == ["s.json", "c.json"]
    body = json.loads((tmp_path / "root" / EVENTS_DIR / "run-a" / files[0]).read_text())
    assert body["format"] == 1 and body["run"] == "run-a" and body["snapshot"] is True and len(body["spans"]) == 8
    assert read_events(storage, "run-a") == sorted(written, key=lambda s: (s.step, s.start))
    assert runs_with_events(storage) == ["run-a"]


def test_a_reader_ignores_what_a_snapshot_superseded(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    store = EventStore(storage, "r", max_chunks=0)  # every write is a snapshot
    store.write([], [unit_span(1)])
    store.write([], [unit_span(1), unit_span(2)])
    # A leftover chunk from before the snapshot (its removal failed): superseded, not read.
    d = tmp_path / "root" / EVENTS_DIR / "r"
    (d / "0000000000001-dead-000001-c.json").write_text(json.dumps({"format": 1, "run": "r",
                                                                    "spans": [unit_span(9).to_dict()]}))
    assert [s.step for s in read_events(storage, "r")] == [1, 2]


def test_a_restarted_recorder_keeps_the_history_already_flushed(tmp_path):
    storage = Storage(str(tmp_path / "root"))

    async def life(spans: list[Span]) -> Recorder:
        rec = Recorder(storage, "r", attempt=0, max_steps=100, flush_s=60, in_thread=in_thread)
        for s in spans:
            rec.commit(s.step, ["checkpoint"], s.start, s.end, None)
        assert await rec.flush() is True
        return rec

    asyncio.run(life([unit_span(1), unit_span(2)]))
    second = asyncio.run(life([unit_span(3)]))
    assert [s["step"] for s in second.spans()] == [1, 2, 3]
    # What the first monitor flushed was loaded as flushed: not written twice.
    assert [s.step for s in read_events(storage, "r")] == [1, 2, 3]


def test_a_failed_flush_is_logged_and_retried_never_raised(tmp_path, caplog):
    (tmp_path / "blocker").write_text("a file where the root's directory should be")
    storage = Storage(str(tmp_path / "blocker" / "root"))

    async def main() -> tuple[bool, Recorder]:
        rec = Recorder(storage, "r", attempt=0, max_steps=100, flush_s=60, in_thread=in_thread)
        rec.upload(1, 100.0, 101.0, None, "10 bytes")
        ok = await rec.flush()
        return ok, rec

    ok, rec = asyncio.run(main())
    assert ok is False and rec.flush_errors == 1
    assert [s.step for s in rec.log.take_unflushed()] == [1]  # still queued for the next batch
    assert "could not persist 1 timeline spans" in caplog.text


# -- what workers send ---------------------------------------------------------------------------


def test_outbox_drains_into_spans_and_stays_bounded():
    box = protocol.TimingOutbox(limit=3)
    assert box.drain() is None
    unit = protocol.UnitId("rank0", "model", 7, Kind.STATE_DICT, "abc-1")
    box.unit(unit, 10.0, 10.5, 12.0)
    for i in range(4):
        box.blocked("rank0", i, 1.0 + i, 1.5 + i, "save_async")
    timing = box.drain()
    assert box.drain() is None
    spans = spans_from_timing(timing, attempt=2)
    assert [(s.lane, s.step) for s in spans] == [(UNIT, 7), (BLOCKED, 1), (BLOCKED, 2), (BLOCKED, 3)]
    assert spans[0] == Span(UNIT, 7, 10.0, 12.0, worker="rank0", name="model", kind="state_dict", admitted=10.5,
                            attempt=2)


def test_payloads_without_timing_and_malformed_timing_are_harmless(tmp_path, caplog):
    async def main() -> Recorder:
        rec = Recorder(Storage(str(tmp_path / "root")), "r", 0, 100, 60, in_thread)
        rec.notification(None)  # a "started" payload of an older coordinator
        rec.notification({"files": [], "found": False})  # its "finished" payload
        rec.notification({"error_type": "OSError", "message": "x", "unit": "u"})  # "failed"
        rec.notification({protocol.TIMING_KEY: {"units": [{"unit": {"step": "x"}}], "blocked": [{"step": 1}]}})
        rec.notification({protocol.TIMING_KEY: {"blocked": [{"worker": "w", "step": 4, "start": 1, "end": 2}]}})
        return rec

    rec = asyncio.run(main())
    assert [(s["lane"], s["step"]) for s in rec.spans()] == [(BLOCKED, 4)]
    assert "ignoring a malformed unit timing" in caplog.text


def test_timeline_options_are_validated():
    assert MonitorOptions.parse({}).timeline_steps == 1000
    with pytest.raises(CheckpointConfigError, match="timeline_steps must be >= 1"):
        MonitorOptions.parse({"timeline_steps": 0})
    with pytest.raises(CheckpointConfigError, match="timeline_flush_s must be > 0"):
        MonitorOptions.parse({"timeline_flush_s": 0})


# -- layout --------------------------------------------------------------------------------------


def test_layout_rows_bars_and_numbers():
    spans = []
    for step, t in ((1, 100.0), (2, 110.0)):
        for w in ("rank10", "rank2"):
            spans += [unit_span(step, worker=w, name="shards", start=t),
                      unit_span(step, worker=w, name="extra", start=t),
                      Span(BLOCKED, step, t - 0.01, t, worker=w, name="save_state_async")]
        spans += [Span(COMMIT, step, t + 2, t + 2.05, name="checkpoint"), Span(MIRROR, step, t + 3, t + 5)]
    spans.append(spans[0])  # a retried notification delivered the same timing twice
    spans.append(Span(UNIT, 2, 111.0, 111.5, worker="rank2", name="late", kind="state_dict", error="OSError: full"))
    layout = build_layout(spans, "r")
    assert [r.key for r in layout.rows] == [
        "unit:rank2:extra", "unit:rank2:late", "unit:rank2:shards", "blocked:rank2",
        "unit:rank10:extra", "unit:rank10:shards", "blocked:rank10", "commit", "mirror"]
    assert layout.t0 == pytest.approx(99.99) and layout.duration == pytest.approx(115.0 - 99.99)
    shards = layout.row("unit:rank10:shards").bars
    assert [(b.step, b.color, b.label) for b in shards] == [(1, "checkpoint", "1"), (2, "checkpoint", "2")]
    assert shards[0].start == pytest.approx(0.01) and shards[0].ready == pytest.approx(0.26)
    assert "admitted after 250.0 ms, wrote for 750.0 ms" in shards[0].tooltip
    assert layout.row("unit:rank2:late").bars[0].color == "failed"
    assert layout.row("blocked:rank2").title == "rank2 · blocked/step: median 10.0 ms, max 10.0 ms"
    assert [(m.step, round(m.start, 2), round(m.committed, 2)) for m in layout.steps] == [(1, 0.0, 2.06),
                                                                                         (2, 10.0, 12.06)]
    first, second = layout.table
    assert (first.step, first.kinds, first.units, first.failed) == (1, "checkpoint", 4, 0)
    assert first.blocked_ms == {"rank2": pytest.approx(10.0), "rank10": pytest.approx(10.0)}
    assert first.commit_ms == pytest.approx(50.0) and first.mirror_s == pytest.approx(2.0)
    assert (second.units, second.failed, second.error) == (5, 1, "OSError: full")
    assert build_layout([]).rows == ()


def test_html_is_self_contained_and_escapes_names():
    spans = [unit_span(1, worker="<w>", name="a&b"), Span(COMMIT, 1, 102.0, 102.1, name="checkpoint")]
    page = render_html(build_layout(spans, "r<1>"))
    assert "<script" not in page and "<w>" not in page and "&lt;w&gt;" in page
    assert '<title>step 1: &lt;w&gt;/a&amp;b (checkpoint)' in page
    assert page.count('class="span"') == 2 and page.count("<tr data-step=") == 1


def test_only_the_newest_attempt_is_drawn_by_default():
    from ckptd.timeline import newest_attempt

    spans = [unit_span(1, attempt=0), unit_span(1, start=5000.0, attempt=1), unit_span(2, start=5010.0, attempt=1)]
    assert [(s.step, s.attempt) for s in newest_attempt(spans)] == [(1, 1), (2, 1)]
    assert newest_attempt([]) == []


def test_png_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    import sys

    from ckptd.errors import CheckpointError
    from ckptd.timeline import render

    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without the viz extra sees
    with pytest.raises(CheckpointError, match=r"pip install 'ckptd\[viz\]'"):
        render([unit_span(1)], str(tmp_path / "t.png"), "r")
    assert not (tmp_path / "t.png").exists()
    render([unit_span(1)], str(tmp_path / "t.html"), "r")  # HTML needs nothing
    assert (tmp_path / "t.html").stat().st_size > 1000
