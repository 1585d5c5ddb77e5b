"""The metric definitions and the monitor's gauges, without Ray (tests/integration/test_metrics.py
scrapes the real endpoint)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from ckptd import metrics as m
from ckptd.config import Kind, SaveStrategy
from ckptd.monitor.gauges import Gauges, gauge_values
from ckptd.monitor.ledger import StepState
from ckptd.monitor.status import (
    MirrorState,
    MirrorStatus,
    MirrorStepStatus,
    MonitorStatus,
    RetentionStatus,
    StepStatus,
    StorageStatus,
    SubscriberStatus,
    Trackers,
    WriterSlotsStatus,
)

NOW = 1_000_000.0
CK, SD = Kind.CHECKPOINT, Kind.STATE_DICT


def step(n: int, kind: Kind, state: StepState, age_s: float) -> StepStatus:
    return StepStatus(step=n, kind=kind, state=state, committed=state is StepState.COMMITTED, expected=1,
                      monitored=True, started=[], finished=[], failed=[], reason=None, first_seen=NOW - age_s,
                      ready_at=None, committed_at=None)


def subscriber(name: str, live: bool, lag_steps: int | None, lag_s: float | None, kind: Kind = CK) -> SubscriberStatus:
    return SubscriberStatus(id=name, name=name, kind=kind, where="here", live=live, last_seen=NOW,
                            serving=None if lag_steps is None else 10 - lag_steps, serving_since=NOW,
                            lag_steps=lag_steps, lag_s=lag_s, pins=[])


def mirror(checkpoint: int | None, *uploads: tuple[int, MirrorState, float]) -> MirrorStatus:
    return MirrorStatus(
        url="s3://b/r", trackers=Trackers(checkpoint=checkpoint, state_dict=checkpoint), queued=[], uploading=None,
        steps=[MirrorStepStatus(step=s, state=state, attempts=1, error=None, bytes=0, queued_at=NOW - age,
                                finished_at=None) for s, state, age in uploads],
        retried_requests=0, uploaded_bytes=0, start_error=None, deleted_steps=[], retention_errors=[])


def status(steps=(), trackers=(None, None), mirror_status=None, subscribers=()) -> MonitorStatus:
    return MonitorStatus(
        run="r", root="/root", attempt=0, fenced=None,
        trackers=Trackers(checkpoint=trackers[0], state_dict=trackers[1]), steps=list(steps),
        writers=WriterSlotsStatus(strategy=SaveStrategy.UNRESTRICTED, holders=[], waiting=[]),
        retention=RetentionStatus(passes=0, deleted_steps=[], errors=[]), notifications=0,
        storage=StorageStatus(commit_strategy="rename", monitor="here", probes_checked=0, unshared=[]),
        mirror=mirror_status, started_at=NOW - 100, warnings=[], subscribers=list(subscribers))


def values(st: MonitorStatus, served: set[Kind] | None = None) -> dict[tuple[str, str], float]:
    return {(g.spec.name, g.labels.get("kind", "")): g.value for g in gauge_values(st, NOW, served)}


def test_names_follow_prometheus_conventions():
    names = [spec.name for spec in m.METRICS]
    assert len(names) == len(set(names))
    for spec in m.METRICS:
        assert re.fullmatch(r"ckptd_[a-z_]+", spec.name), spec.name
        assert spec.exported == "ray_" + spec.name
        assert spec.labels[0] == "run" and not {"step", "unit", "file"} & set(spec.labels), spec.name
        assert spec.name.endswith("_total") == (spec.type is m.MetricType.COUNTER), spec.name
        if spec.type is m.MetricType.HISTOGRAM:
            assert spec.name.endswith(("_seconds", "_bytes")), spec.name
            b = spec.boundaries
            assert b and b[0] > 0 and all(x < y for x, y in zip(b, b[1:], strict=False)), spec.name
        else:
            assert not spec.boundaries


def test_steps_in_flight_and_the_age_of_the_oldest():
    st = status(steps=[step(9, CK, StepState.COMMITTED, 300), step(10, CK, StepState.PENDING, 30),
                       step(11, CK, StepState.COMMITTING, 5), step(11, SD, StepState.FAILED, 5),
                       step(12, SD, StepState.PENDING, 2)], trackers=(9, 9))
    v = values(st)
    assert v[("ckptd_steps_in_flight", "checkpoint")] == 2
    assert v[("ckptd_oldest_pending_step_age_seconds", "checkpoint")] == pytest.approx(30)
    assert v[("ckptd_steps_in_flight", "state_dict")] == 1
    assert v[("ckptd_oldest_pending_step_age_seconds", "state_dict")] == pytest.approx(2)
    assert v[("ckptd_latest_committed_step", "checkpoint")] == 9


def test_nothing_in_flight_reads_zero_and_no_commit_has_no_latest_step():
    v = values(status(steps=[step(9, CK, StepState.COMMITTED, 300)]))
    assert v[("ckptd_steps_in_flight", "checkpoint")] == 0
    assert v[("ckptd_oldest_pending_step_age_seconds", "checkpoint")] == 0
    assert not any(name == "ckptd_latest_committed_step" for name, _ in v)
    assert not any(name.startswith(("ckptd_mirror", "ckptd_served", "ckptd_live")) for name, _ in v)


def test_mirror_lag_counts_steps_behind_and_the_oldest_upload_not_done():
    behind = mirror(12, (12, MirrorState.MIRRORED, 90), (15, MirrorState.FAILED, 50), (20, MirrorState.QUEUED, 5))
    v = values(status(trackers=(20, 20), mirror_status=behind))
    assert v[("ckptd_mirror_lag_steps", "")] == 8
    assert v[("ckptd_mirror_lag_seconds", "")] == pytest.approx(50)
    caught_up = values(status(trackers=(20, 20), mirror_status=mirror(20, (20, MirrorState.MIRRORED, 5))))
    assert caught_up[("ckptd_mirror_lag_steps", "")] == 0 and caught_up[("ckptd_mirror_lag_seconds", "")] == 0
    empty = values(status(trackers=(20, 20), mirror_status=mirror(None, (20, MirrorState.UPLOADING, 3))))
    assert empty[("ckptd_mirror_lag_steps", "")] == 20
    assert empty[("ckptd_mirror_lag_seconds", "")] == pytest.approx(3)


def test_served_version_lag_is_the_worst_live_subscriber_and_stays_after_they_leave():
    served: set[Kind] = set()
    subs = [subscriber("a", True, 3, 10.0), subscriber("b", True, 1, 2.0), subscriber("dead", False, 50, 900.0),
            subscriber("new", True, None, None, kind=SD)]
    v = values(status(trackers=(10, 10), subscribers=subs), served)
    assert v[("ckptd_served_version_lag_steps", "checkpoint")] == 3
    assert v[("ckptd_served_version_lag_seconds", "checkpoint")] == pytest.approx(10)
    assert v[("ckptd_live_subscribers", "checkpoint")] == 2
    assert ("ckptd_served_version_lag_steps", "state_dict") not in v  # no state-dict subscriber serves yet
    # The subscribers left: the gauges read 0 instead of keeping their last value.
    v = values(status(trackers=(10, 10)), served)
    assert v[("ckptd_served_version_lag_steps", "checkpoint")] == 0
    assert v[("ckptd_live_subscribers", "checkpoint")] == 0


def test_recording_without_ray_or_turned_off_does_nothing_and_never_raises(monkeypatch):
    """Unit tests run without Ray: every call is a no-op, even with labels missing or bad values."""
    # In a fresh interpreter: this worker process may have Ray up for the integration tests.
    script = """
from ckptd import metrics as m
from ckptd.config import Kind
run, off = m.RunMetrics("r"), m.RunMetrics(None)
for spec in m.METRICS:
    for rec in (run, off):
        rec.inc(spec, 1) if spec.type is m.MetricType.COUNTER else rec.set(spec, 1, kind=Kind.CHECKPOINT)
        rec.observe(spec, float("nan"), bogus="label")
assert m._instruments == {}, sorted(m._instruments)  # nothing is created without ray.init
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    run = m.RunMetrics("r")
    monkeypatch.setenv("CKPTD_METRICS", "off")
    assert not m.enabled()
    asked = []
    Gauges(run).refresh(lambda: asked.append(1))
    assert not asked  # turned off: the status is not even built


def test_a_gauge_refresh_that_fails_is_logged_once_and_does_not_raise(caplog):
    gauges = Gauges(m.RunMetrics("r"))

    def broken() -> MonitorStatus:
        raise RuntimeError("status is broken")

    with caplog.at_level(logging.WARNING, logger="ckptd.metrics"):
        gauges.refresh(broken)
        gauges.refresh(broken)
    assert [r.getMessage() for r in caplog.records].count(
        "could not update the monitor's gauges: RuntimeError: status is broken") == 1


def test_the_docs_list_every_exported_name_with_its_type():
    """docs/metrics.md's table is what users build dashboards from: it must match the code."""
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "metrics.md")
    with open(doc) as f:
        rows = re.findall(r"^\| `(ray_ckptd_\w+)` \| (\w+) \| ([\w, ]+) \|", f.read(), re.MULTILINE)
    listed = {name: (kind, tuple(label.strip() for label in labels.split(","))) for name, kind, labels in rows}
    assert listed == {spec.exported: (spec.type.value, spec.labels) for spec in m.METRICS}
