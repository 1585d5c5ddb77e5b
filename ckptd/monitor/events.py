"""The events ``ckptd timeline`` draws: spans of time, kept in a bounded buffer and persisted.

A :class:`Span` is one thing that took time in a step: a save unit on a worker, the training
thread blocked in a save call, the monitor's commit, or the upload of the step to the mirror.
Spans come from where they happened (workers send theirs with their notifications, see
:class:`ckptd.protocol.TimingOutbox`; the monitor adds its own), in wall-clock seconds.

:class:`EventLog` keeps the spans of the newest ``max_steps`` steps in memory, dropping the
oldest steps first, and remembers which spans are not persisted yet.
:class:`~ckptd.monitor.event_store.EventStore` writes them under the root, per run, as
immutable chunk files; no append, so it works on object stores as on POSIX::

    root/.ckptd/events/{run}/{ms}-{nonce}-{seq}-c.json   a chunk: spans recorded since the last one
    root/.ckptd/events/{run}/{ms}-{nonce}-{seq}-s.json   a snapshot: every span then in memory

Names sort in the order they were written. A reader takes the newest snapshot and the chunks
after it; what precedes the snapshot is superseded (the writer deletes it after writing the
snapshot). Each file is ``{"format": 1, "run": ..., "spans": [...]}``, published atomically.

Plain Python, no Ray: the monitor actor owns one :class:`EventLog` and one
:class:`~ckptd.monitor.event_store.EventStore` through :class:`ckptd.monitor.recorder.Recorder`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

log = logging.getLogger("ckptd.monitor")

DEFAULT_MAX_STEPS = 1000
DEFAULT_MAX_SPANS = 200_000

UNIT, BLOCKED, COMMIT, MIRROR = "unit", "blocked", "commit", "mirror"
LANES = (UNIT, BLOCKED, COMMIT, MIRROR)


@dataclass(frozen=True)
class Span:
    """One thing that took time in a step.

    Attributes:
        lane: ``"unit"`` (a save unit on a worker), ``"blocked"`` (the worker's training thread
            inside a save call or the fence), ``"commit"`` (the monitor committing the step) or
            ``"mirror"`` (the step's upload to the mirror).
        step: The training step.
        start, end: Wall-clock seconds (``time.time()`` where it happened).
        worker: The coordinator's worker id (units and blocked time); None for the monitor.
        name: The unit's name; for blocked time, the call (``save_async``, ``before_update
            (fence)``...); for a commit, the kinds (``checkpoint+state_dict``).
        kind: ``checkpoint`` or ``state_dict`` for units; None otherwise.
        admitted: Units: when the save function started (after admission and any writer slot).
        error: Why it failed; None when it succeeded.
        detail: Free text for the tooltip (bytes uploaded, ...).
        attempt: The monitor's attempt (job) that recorded it.
        phases: Seconds per phase (:mod:`ckptd.phases`): a unit's ``staging``, ``write``,
            ``checksum``, ``fsync``, ``receipt`` and ``notification``; a commit's ``commit`` and
            ``trackers``. None where not measured (spans of older coordinators and monitors).

    Spans are identified by :attr:`identity`: a later record of the same span (one whose phases
    were completed) supersedes an earlier one.
    """

    lane: str
    step: int
    start: float
    end: float
    worker: str | None = None
    name: str = ""
    kind: str | None = None
    admitted: float | None = None
    error: str | None = None
    detail: str = ""
    attempt: int = 0
    phases: dict[str, float] | None = field(default=None, hash=False, compare=False)

    @property
    def identity(self) -> tuple:
        return (self.lane, self.worker, self.name, self.step, self.start)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)

    def to_dict(self) -> dict:
        # Not dataclasses.asdict: it deep-copies field by field, and a flush writes every span.
        out = {f: getattr(self, f) for f in _SPAN_FIELDS}
        if self.phases is not None:
            out["phases"] = dict(self.phases)
        return {k: v for k, v in out.items() if v not in (None, "")}

    @classmethod
    def from_dict(cls, d: dict) -> Span:
        if d.get("lane") not in LANES:
            raise ValueError(f"unknown span lane {d.get('lane')!r}")
        return cls(lane=d["lane"], step=int(d["step"]), start=float(d["start"]), end=float(d["end"]),
                   worker=d.get("worker"), name=str(d.get("name", "")), kind=d.get("kind"),
                   admitted=None if d.get("admitted") is None else float(d["admitted"]), error=d.get("error"),
                   detail=str(d.get("detail", "")), attempt=int(d.get("attempt", 0)),
                   phases=phases_of(d.get("phases")))


_SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(Span) if f.name != "phases")


def phases_of(value: object) -> dict[str, float] | None:
    """Phase timings as sent or stored: names to finite seconds >= 0; anything else is left out
    (a worker's bad timing must never fail its save, nor hide its span)."""
    if not isinstance(value, dict):
        return None
    out = {}
    for name, seconds in value.items():
        try:
            seconds = float(seconds)
        except (TypeError, ValueError):
            continue
        if isinstance(name, str) and math.isfinite(seconds) and seconds >= 0:
            out[name] = seconds
    return out or None


def spans_from_timing(timing: dict, attempt: int = 0) -> list[Span]:
    """The spans in a notification's timing payload (see :class:`ckptd.protocol.TimingOutbox`);
    malformed entries are skipped with a warning (a worker's bad timing must never fail its save)."""
    out: list[Span] = []
    for entry in timing.get("units") or []:
        try:
            unit = entry["unit"]
            error = entry.get("error")
            out.append(Span(UNIT, int(unit["step"]), float(entry["start"]), float(entry["end"]),
                            worker=str(unit["worker"]), name=str(unit["name"]), kind=str(unit["kind"]),
                            admitted=None if entry.get("admitted") is None else float(entry["admitted"]),
                            # str: a span must stay JSON-writable, or every later flush would fail on it
                            error=None if error is None else str(error), attempt=attempt,
                            phases=phases_of(entry.get("phases"))))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            log.warning("ignoring a malformed unit timing %r: %s", str(entry)[:200], e)
    for entry in timing.get("blocked") or []:
        try:
            out.append(Span(BLOCKED, int(entry["step"]), float(entry["start"]), float(entry["end"]),
                            worker=str(entry["worker"]), name=str(entry.get("what", "")), attempt=attempt))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            log.warning("ignoring a malformed blocked timing %r: %s", str(entry)[:200], e)
    return out


@dataclass(frozen=True)
class Amendment:
    """Phases measured after a unit's span was sent (``timing["amended"]``): they are added to
    the unit span of ``worker``, ``name`` and ``step`` that started at ``start``."""

    step: int
    worker: str
    name: str
    start: float
    phases: dict[str, float]

    @property
    def identity(self) -> tuple:
        return (UNIT, self.worker, self.name, self.step, self.start)


def amendments_from_timing(timing: dict) -> list[Amendment]:
    """The amendments in a notification's timing payload; malformed entries are skipped."""
    out = []
    entries = timing.get("amended") or []
    for entry in entries if isinstance(entries, list) else []:
        try:
            unit = entry["unit"]
            phases = phases_of(entry.get("phases"))
            if phases:
                out.append(Amendment(int(unit["step"]), str(unit["worker"]), str(unit["name"]),
                                     float(entry["start"]), phases))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            log.warning("ignoring a malformed timing amendment %r: %s", str(entry)[:200], e)
    return out


class EventLog:
    """The spans of the newest ``max_steps`` steps, in memory; thread-safe.

    Args:
        max_steps: Steps kept; when a span of a new step would exceed it, the oldest (lowest)
            step goes, with all its spans. A span of a step older than every kept one, once the
            log is full, is not kept.
        max_spans: Spans kept in all; the oldest steps go first to stay under it (the newest step
            is always kept whole).
    """

    def __init__(self, max_steps: int = DEFAULT_MAX_STEPS, max_spans: int = DEFAULT_MAX_SPANS) -> None:
        if max_steps < 1 or max_spans < 1:
            raise ValueError(f"max_steps and max_spans must be >= 1, got {max_steps} and {max_spans}")
        self.max_steps = max_steps
        self.max_spans = max_spans
        self._lock = threading.Lock()
        self._steps: dict[int, list[Span]] = {}
        self._where: dict[tuple, int] = {}  # a span's identity -> its index in its step's list
        self._count = 0
        self._unflushed: list[Span] = []
        self._pending: dict[int, int] = {}  # id() of an unflushed span -> its index there
        self.dropped_steps = 0

    def add(self, spans: Iterable[Span], *, flushed: bool = False) -> None:
        """Keep ``spans``; ``flushed`` marks them as already persisted (loaded back from storage)."""
        with self._lock:
            for span in spans:
                if span.step not in self._steps:
                    if len(self._steps) >= self.max_steps and span.step < min(self._steps):
                        continue  # older than everything kept in a full log
                    self._steps[span.step] = []
                kept = self._steps[span.step]
                i = self._where.get(span.identity)
                if i is not None:
                    # A span kept already, sent again (Ray retried its notification): one record
                    # per span, as readers keep, with the phases of both (amendments included).
                    old = kept[i]
                    new = dataclasses.replace(span, phases={**(span.phases or {}), **(old.phases or {})} or None)
                    if new != old or new.phases != old.phases:
                        self._replace(kept, i, new)
                    continue
                self._where[span.identity] = len(kept)
                kept.append(span)
                self._count += 1
                if not flushed:
                    self._pending[id(span)] = len(self._unflushed)
                    self._unflushed.append(span)
            self._trim()

    def _trim(self) -> None:
        dropped = set()
        while len(self._steps) > self.max_steps or (self._count > self.max_spans and len(self._steps) > 1):
            oldest = min(self._steps)
            gone = self._steps.pop(oldest)
            self._count -= len(gone)
            for span in gone:
                self._where.pop(span.identity, None)
            dropped.add(oldest)
        if dropped:
            self.dropped_steps += len(dropped)
            self._set_unflushed([s for s in self._unflushed if s.step not in dropped])

    def _set_unflushed(self, spans: list[Span]) -> None:
        self._unflushed = spans
        self._pending = {id(s): i for i, s in enumerate(spans)}

    def amend(self, amendments: Iterable[Amendment]) -> None:
        """Add the phases of each amendment to its span; the span is persisted again if it was
        already (readers keep the later record). An amendment of a span not kept is dropped."""
        with self._lock:  # constant time per amendment: a step may hold 40,000 unit spans
            for a in amendments:
                i = self._where.get(a.identity)
                if i is None:
                    continue
                spans = self._steps[a.step]
                span = spans[i]
                self._replace(spans, i, dataclasses.replace(span, phases={**(span.phases or {}), **a.phases}))

    def _replace(self, spans: list[Span], i: int, new: Span) -> None:
        """Put ``new`` in place of ``spans[i]``, to be persisted (again): in the old record's place
        among the unflushed spans if it is there, else after them (readers keep the later record)."""
        old = spans[i]
        spans[i] = new
        j = self._pending.pop(id(old), None)
        if j is None:
            j = len(self._unflushed)
            self._unflushed.append(new)
        else:
            self._unflushed[j] = new
        self._pending[id(new)] = j

    def spans(self) -> list[Span]:
        """Every span kept, by step, then start time."""
        with self._lock:
            return sorted((s for spans in self._steps.values() for s in spans), key=lambda s: (s.step, s.start))

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def take_unflushed(self) -> list[Span]:
        """The spans not persisted yet; they count as persisted from now (see :meth:`give_back`)."""
        with self._lock:
            out = self._unflushed
            self._set_unflushed([])
        return out

    def give_back(self, spans: list[Span]) -> None:
        """Spans whose write failed: to be written with the next batch (unless their step was dropped)."""
        with self._lock:
            self._set_unflushed([s for s in spans if s.step in self._steps] + self._unflushed)
