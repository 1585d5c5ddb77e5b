"""The monitor's gauges, computed from its status. :func:`gauge_values` is plain Python; the
actor's housekeeping calls :meth:`Gauges.refresh` once per round, which records them through
:mod:`ckptd.metrics`. Every gauge is set every round, 0 included: Ray (2.60) exports a gauge
only if it was set since the last export, and its metrics agent drops a series that was not
refreshed within two report intervals (at least 2 s), so a gauge set once would vanish."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd import metrics as m
from ckptd.config import Kind
from ckptd.monitor.ledger import StepState
from ckptd.monitor.status import MirrorState, MonitorStatus

log = logging.getLogger("ckptd.metrics")

_IN_FLIGHT = (StepState.PENDING, StepState.COMMITTING)
_NOT_MIRRORED = (MirrorState.QUEUED, MirrorState.UPLOADING, MirrorState.FAILED)


@dataclass(frozen=True)
class GaugeValue:
    spec: m.MetricSpec
    labels: dict[str, str]
    value: float


def gauge_values(status: MonitorStatus, now: float, served_kinds: set[Kind] | None = None) -> list[GaugeValue]:
    """What each gauge reads now.

    Args:
        status: The monitor's status.
        now: The current time (``time.time()``).
        served_kinds: Kinds a subscriber has served since the monitor started; their served-version
            gauges stay (at 0) when no subscriber is live, instead of keeping a stale value.
            Updated in place with the kinds of ``status.subscribers``.
    """
    out: list[GaugeValue] = []
    for kind in Kind:
        flight = [s for s in status.steps if s.kind is kind and s.state in _IN_FLIGHT]
        labels = {"kind": kind.value}
        out.append(GaugeValue(m.STEPS_IN_FLIGHT, labels, len(flight)))
        out.append(GaugeValue(m.OLDEST_PENDING_AGE, labels,
                              max(0.0, now - min(s.first_seen for s in flight)) if flight else 0.0))
        newest = getattr(status.trackers, kind.value)
        if newest is not None:
            out.append(GaugeValue(m.LATEST_STEP, labels, newest))
    out += _mirror(status, now)
    out += _served(status, served_kinds if served_kinds is not None else set())
    return out


def mirror_lag(status: MonitorStatus, now: float) -> tuple[int | None, float]:
    """How far the mirror is behind the root: in training steps (the root's newest checkpoint
    against the mirror's; None before the first checkpoint) and in seconds (the age of the
    oldest step committed on the root and not yet on the mirror; 0 when none waits)."""
    mirror = status.mirror
    assert mirror is not None
    # Checkpoints always go to the mirror; its tracker is what a reader of the mirror resumes from.
    local, remote = status.trackers.checkpoint, mirror.trackers.checkpoint
    steps = None if local is None else max(0, local - remote if remote is not None else local)
    waiting = [s.queued_at for s in mirror.steps if s.state in _NOT_MIRRORED]
    return steps, max(0.0, now - min(waiting)) if waiting else 0.0


def _mirror(status: MonitorStatus, now: float) -> list[GaugeValue]:
    if status.mirror is None:
        return []
    steps, seconds = mirror_lag(status, now)
    out = [] if steps is None else [GaugeValue(m.MIRROR_LAG_STEPS, {}, steps)]
    return out + [GaugeValue(m.MIRROR_LAG_SECONDS, {}, seconds)]


def _served(status: MonitorStatus, served_kinds: set[Kind]) -> list[GaugeValue]:
    served_kinds.update(s.kind for s in status.subscribers if s.serving is not None)
    out = []
    for kind in sorted(served_kinds, key=lambda k: k.value):
        live = [s for s in status.subscribers if s.kind is kind and s.live]
        labels = {"kind": kind.value}
        out.append(GaugeValue(m.LIVE_SUBSCRIBERS, labels, len(live)))
        out.append(GaugeValue(m.SERVED_LAG_STEPS, labels, max((s.lag_steps or 0 for s in live), default=0)))
        # None: the newer version was published before this monitor started (its time is unknown).
        seconds = [s.lag_s for s in live if s.lag_s is not None]
        out.append(GaugeValue(m.SERVED_LAG_SECONDS, labels, max(seconds, default=0.0)))
    return out



class Gauges:
    """Sets the monitor's gauges from its status, once per housekeeping round.

    Args:
        metrics: The run's metrics.
    """

    def __init__(self, metrics: m.RunMetrics) -> None:
        self._metrics = metrics
        self._served_kinds: set[Kind] = set()
        self._failed = False

    def refresh(self, status: Callable[[], MonitorStatus]) -> None:
        """Set every gauge from ``status()``. Never raises: a failure is logged once, and the
        caller (housekeeping) goes on."""
        if not m.enabled():
            return
        try:
            for g in gauge_values(status(), time.time(), self._served_kinds):
                self._metrics.set(g.spec, g.value, **g.labels)
        except Exception as e:
            if not self._failed:
                self._failed = True
                log.warning("could not update the monitor's gauges: %s: %s", type(e).__name__, e)
