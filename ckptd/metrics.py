"""Prometheus metrics, recorded through Ray's metrics API (:mod:`ray.util.metrics`).

Every metric ckptd records is defined here, once: its name, type, description, labels and, for
histograms, bucket boundaries suited to the quantity. Ray's metrics agent (installed with
``ray[default]``) serves them on each node's metrics export port, the endpoint Ray's Prometheus
integration already scrapes, with ``ray_`` put in front of each name (``ckptd_commit_latency_seconds``
is scraped as ``ray_ckptd_commit_latency_seconds``); see docs/metrics.md.

Who records what: the coordinator (in each training worker) records how long save calls block
training, unit durations and bytes, and retried calls to the monitor; the monitor records commits,
failures, retries and retention deletions as they happen, and sets the gauges from its status
once per housekeeping round (:mod:`ckptd.monitor.gauges`).

Labels: ``run`` always, ``kind`` (``checkpoint`` / ``state_dict``) where it means something, and a
few closed sets (``request``, ``tier``). Never a step, unit or file: cardinality stays bounded.

NOTE: recording never raises and never blocks on I/O. Without Ray, before ``ray.init``, with a
Ray that cannot create metrics, or with ``CKPTD_METRICS=0`` in the environment, every call is a
no-op; a failure is logged once per metric. Metrics must never make a save or a commit fail.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any

log = logging.getLogger("ckptd.metrics")

RAY_PREFIX = "ray_"  # what Ray's exporter puts in front of every application metric


class MetricType(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One metric. ``name`` is what ckptd records; :attr:`exported` is what Prometheus scrapes."""

    name: str
    type: MetricType
    description: str
    labels: tuple[str, ...]
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        return RAY_PREFIX + self.name


_C, _G, _H = MetricType.COUNTER, MetricType.GAUGE, MetricType.HISTOGRAM
_RUN_KIND = ("run", "kind")

# Ray re-aggregates histograms in its metrics agent from bucket counts, using bucket midpoints,
# so a histogram's _sum is an estimate whose error is set by the bucket widths (and a value past
# the last boundary counts as twice it). Hence fairly fine buckets, and exact counters beside the
# histograms whose totals matter (bytes).
_FAST_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0, 120.0)
_SLOW_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
_BYTES = tuple(float(2**e) for e in range(10, 38, 2))  # 1 KiB .. 128 GiB, by factors of 4

SAVE_BLOCKED = MetricSpec(
    "ckptd_save_blocked_seconds", _H,
    "Time a save call (save_async, save_state_async, save_sync) held up the calling training thread: "
    "back-pressure, the eager staging copy, or the whole save for save_sync.", _RUN_KIND, _FAST_S)
FENCE_WAIT = MetricSpec(
    "ckptd_fence_wait_seconds", _H,
    "Time before_update() waited for fenced staging copies to finish (calls that followed a fenced "
    "save_state_async; 0 when the copies were done already).",
    ("run",), _FAST_S)
UNIT_DURATION = MetricSpec(
    "ckptd_save_unit_duration_seconds", _H,
    "Duration of a save unit that succeeded, from its start in the save thread (writer slot wait "
    "included) until the monitor acknowledged it.", _RUN_KIND, _SLOW_S)
UNIT_BYTES = MetricSpec(
    "ckptd_save_unit_bytes", _H, "Bytes written by a save unit that succeeded (the sizes of the files it "
    "reported).", _RUN_KIND, _BYTES)
WRITTEN_BYTES = MetricSpec(
    "ckptd_written_bytes_total", _C, "Bytes written by save units that succeeded (exact; the histogram's "
    "_sum is an estimate).", _RUN_KIND)
COMMIT_LATENCY = MetricSpec(
    "ckptd_commit_latency_seconds", _H,
    "Time from the moment a step's kind was ready (its last unit reported) until it was committed "
    "(manifest and tracker written, retries included).", _RUN_KIND, _FAST_S)
FAILED_UNITS = MetricSpec(
    "ckptd_failed_units_total", _C, "Save units that failed, as the monitor recorded them.", _RUN_KIND)
FAILED_COMMITS = MetricSpec(
    "ckptd_failed_commits_total", _C, "Commits that failed after their retries (the step's kind failed).",
    _RUN_KIND)
FAILED_STEPS = MetricSpec(
    "ckptd_failed_steps_total", _C,
    "Steps whose kind failed, for any reason: a failed unit, a failed commit, a timeout.", _RUN_KIND)
RETRIED_REQUESTS = MetricSpec(
    "ckptd_retried_requests_total", _C,
    "Requests retried after an error. request: commit (the commit's storage I/O), tracker (advancing "
    "a tracker), mirror (an upload, manifest or tracker on the mirror, or reading its state), "
    "monitor_call (a coordinator's call to an unreachable or restarting monitor), relay_call (a relay's "
    "call upstream, or a coordinator's batch sent straight to the monitor when its relay did not answer "
    "in time), failure_record (recording a step's failure, which is reported only once recorded).",
    ("run", "request"))
RETENTION_DELETIONS = MetricSpec(
    "ckptd_retention_deletions_total", _C,
    "Step directories deleted by retention (committed steps past the policy, and leftovers of failed "
    "saves). tier: root or mirror.", ("run", "tier"))
STEPS_IN_FLIGHT = MetricSpec(
    "ckptd_steps_in_flight", _G, "Steps whose kind is registered or being saved and not yet committed "
    "or failed.", _RUN_KIND)
OLDEST_PENDING_AGE = MetricSpec(
    "ckptd_oldest_pending_step_age_seconds", _G,
    "Age of the oldest step in flight (since the monitor first heard of it); 0 when none is.", _RUN_KIND)
LATEST_STEP = MetricSpec(
    "ckptd_latest_committed_step", _G, "The newest committed step (what the tracker points at).", _RUN_KIND)
MIRROR_LAG_STEPS = MetricSpec(
    "ckptd_mirror_lag_steps", _G,
    "Training steps the mirror's newest checkpoint is behind the root's (the root's newest step when "
    "the mirror has none); only with a mirror.", ("run",))
MIRROR_LAG_SECONDS = MetricSpec(
    "ckptd_mirror_lag_seconds", _G,
    "Age of the oldest step committed on the root and not yet on the mirror; 0 when the mirror is "
    "up to date. Only with a mirror.", ("run",))
SERVED_LAG_STEPS = MetricSpec(
    "ckptd_served_version_lag_steps", _G,
    "The largest lag, in steps, of a live weight subscriber's served version behind the newest "
    "commit of its kind; 0 when all serve the newest (or none is live). Only once a subscriber "
    "of the kind has reported.", _RUN_KIND)
SERVED_LAG_SECONDS = MetricSpec(
    "ckptd_served_version_lag_seconds", _G,
    "The largest lag, in seconds, of a live weight subscriber: time since a version newer than the "
    "one it serves was committed; 0 when all serve the newest.", _RUN_KIND)
LIVE_SUBSCRIBERS = MetricSpec(
    "ckptd_live_subscribers", _G, "Weight subscribers that renewed their liveness within read_lease_s.",
    _RUN_KIND)

METRICS: tuple[MetricSpec, ...] = (
    SAVE_BLOCKED, FENCE_WAIT, UNIT_DURATION, UNIT_BYTES, WRITTEN_BYTES, COMMIT_LATENCY, FAILED_UNITS,
    FAILED_COMMITS, FAILED_STEPS, RETRIED_REQUESTS, RETENTION_DELETIONS, STEPS_IN_FLIGHT, OLDEST_PENDING_AGE,
    LATEST_STEP, MIRROR_LAG_STEPS, MIRROR_LAG_SECONDS, SERVED_LAG_STEPS, SERVED_LAG_SECONDS, LIVE_SUBSCRIBERS,
)

# -- the Ray layer -------------------------------------------------------------------------------

_lock = threading.Lock()
_instruments: dict[str, Any] = {}  # one Ray metric object per name and process
_broken: set[str] = set()  # names Ray could not create: off in this process
_logged: set[str] = set()  # names whose recording failed once (logged; later failures are not)


def enabled() -> bool:
    """False when ``CKPTD_METRICS`` is set to 0/false/no/off in this process's environment."""
    return os.environ.get("CKPTD_METRICS", "1").strip().lower() not in ("0", "false", "no", "off")


def _create(spec: MetricSpec) -> Any:
    from ray.util import metrics as ray_metrics

    if spec.type is MetricType.COUNTER:
        return ray_metrics.Counter(spec.name, spec.description, tag_keys=spec.labels)
    if spec.type is MetricType.GAUGE:
        return ray_metrics.Gauge(spec.name, spec.description, tag_keys=spec.labels)
    return ray_metrics.Histogram(spec.name, spec.description, boundaries=list(spec.boundaries),
                                 tag_keys=spec.labels)


def _instrument(spec: MetricSpec) -> Any | None:
    """The Ray metric of ``spec`` in this process, created on first use; None while it cannot be."""
    inst = _instruments.get(spec.name)
    if inst is not None or spec.name in _broken:
        return inst
    try:
        import ray

        if not ray.is_initialized():
            return None  # not yet: a later call, after ray.init, creates it
    except Exception:  # no usable Ray in this process: metrics stay off
        return None
    with _lock:
        inst = _instruments.get(spec.name)
        if inst is None and spec.name not in _broken:
            try:
                inst = _instruments[spec.name] = _create(spec)
            except Exception as e:
                _broken.add(spec.name)
                log.warning("metric %s is off: Ray could not create it (%s: %s)", spec.name, type(e).__name__, e)
    return inst


def _record(spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
    if not enabled():
        return
    try:
        inst = _instrument(spec)
        if inst is None:
            return
        if spec.type is MetricType.COUNTER:
            if value > 0:  # Ray refuses increments <= 0
                inst.inc(float(value), tags=labels)
        elif spec.type is MetricType.GAUGE:
            inst.set(float(value), tags=labels)
        else:
            inst.observe(float(value), tags=labels)
    except Exception as e:  # observability must never break the save or commit path
        if spec.name not in _logged:
            _logged.add(spec.name)
            log.warning("could not record metric %s (%s: %s); further errors of it are not logged",
                        spec.name, type(e).__name__, e)


class RunMetrics:
    """The metrics of one run, as this process records them. Every method returns None and
    never raises.

    Args:
        run: The run's name: the ``run`` label of every series. None records nothing (for
            components used outside a monitor or coordinator, as in unit tests).
    """

    def __init__(self, run: str | None) -> None:
        self.run = run

    def _put(self, spec: MetricSpec, value: float, labels: dict[str, Any]) -> None:
        if self.run is None:
            return
        given = {"run": self.run, **{k: str(getattr(v, "value", v)) for k, v in labels.items()}}  # Kind: its value
        _record(spec, value, {k: given.get(k, "") for k in spec.labels})

    def observe(self, spec: MetricSpec, value: float, **labels: Any) -> None:
        """Add one observation to a histogram."""
        self._put(spec, value, labels)

    def inc(self, spec: MetricSpec, value: float = 1, **labels: Any) -> None:
        """Add ``value`` (> 0; anything else is ignored) to a counter."""
        self._put(spec, value, labels)

    def set(self, spec: MetricSpec, value: float, **labels: Any) -> None:
        """Set a gauge."""
        self._put(spec, value, labels)
