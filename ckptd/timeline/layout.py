"""Where each span goes in the picture: rows of bars, step marks and a table of numbers.

Plain Python over :class:`~ckptd.monitor.events.Span` lists, shared by the PNG and the HTML
drawers (and unit-testable without either). Times are seconds since the run's first span.

Rows, top to bottom: for each worker (in natural order: rank2 before rank10), one row per save
name (its units, coloured by kind) and one for the time its training thread was blocked in save
calls; then the monitor's commits; then the uploads to the mirror (only if there were any).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ckptd.monitor.events import BLOCKED, COMMIT, MIRROR, UNIT, Span

FAILED = "failed"


@dataclass(frozen=True)
class Bar:
    """One span in a row.

    Attributes:
        start, end: Seconds since the run's first span.
        step: Its step.
        color: What it is, for the colour: ``checkpoint``, ``state_dict``, ``blocked``,
            ``commit``, ``mirror`` or ``failed``.
        label: Short text (the step number).
        tooltip: Everything known about it, one fact per line.
        ready: Units: when the save function started (before it: admission and writer slot).
    """

    start: float
    end: float
    step: int
    color: str
    label: str
    tooltip: str
    ready: float | None = None


@dataclass(frozen=True)
class Row:
    """One horizontal lane: ``lane`` is ``unit``, ``blocked``, ``commit`` or ``mirror``."""

    key: str
    title: str
    lane: str
    worker: str | None
    bars: tuple[Bar, ...]


@dataclass(frozen=True)
class StepMark:
    """Where a step starts (its first span) and ends (its last commit), in seconds."""

    step: int
    start: float
    committed: float | None


@dataclass(frozen=True)
class StepNumbers:
    """One step's figures, for the table: milliseconds and seconds as the column names say."""

    step: int
    kinds: str
    blocked_ms: dict[str, float]  # per worker, summed over its save calls and the fence
    units: int
    failed: int
    saving_s: float | None  # first unit start to last unit end
    commit_ms: float | None
    committed_at_s: float | None
    mirror_s: float | None
    error: str | None


@dataclass(frozen=True)
class Layout:
    run: str
    t0: float  # wall-clock time of the first span
    duration: float
    rows: tuple[Row, ...]
    steps: tuple[StepMark, ...]
    table: tuple[StepNumbers, ...]

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)


def natural_key(text: str) -> list:
    """Sort key that orders embedded numbers by value: rank2 < rank10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _unique(spans: Iterable[Span]) -> list[Span]:
    # A notification that Ray retried delivers its timing twice.
    seen, out = set(), []
    for s in spans:
        key = (s.lane, s.worker, s.name, s.step, s.start, s.end)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _tooltip(s: Span, t0: float) -> str:
    what = {UNIT: f"{s.worker}/{s.name} ({s.kind})", BLOCKED: f"{s.worker}: training thread in {s.name}",
            COMMIT: f"commit of {s.name}", MIRROR: "upload to the mirror"}[s.lane]
    lines = [f"step {s.step}: {what}", f"{s.start - t0:.3f} s to {s.end - t0:.3f} s: {_ms(s.duration)}"]
    if s.lane == UNIT and s.admitted is not None:
        waited, wrote = max(0.0, s.admitted - s.start), max(0.0, s.end - s.admitted)
        lines.append(f"admitted after {_ms(waited)}, wrote for {_ms(wrote)}")
    if s.phases:
        lines.append(", ".join(f"{name} {_ms(sec)}" for name, sec in s.phases.items()))
    if s.detail:
        lines.append(s.detail)
    if s.error:
        lines.append(f"FAILED: {s.error}")
    return "\n".join(lines)


def _bar(s: Span, t0: float) -> Bar:
    if s.error:
        color = FAILED
    elif s.lane == UNIT:
        color = s.kind or "checkpoint"
    else:
        color = s.lane
    ready = None if s.lane != UNIT or s.admitted is None else s.admitted - t0
    return Bar(s.start - t0, s.end - t0, s.step, color, str(s.step), _tooltip(s, t0), ready)


def build_layout(spans: Iterable[Span], run: str = "") -> Layout:
    """Turn a run's spans into rows of bars, step marks and per-step figures.

    Args:
        spans: What the monitor recorded (live or persisted), in any order.
        run: The run's name, for titles.

    Returns:
        The layout; with no spans, one without rows.
    """
    spans = _unique(spans)
    if not spans:
        return Layout(run, 0.0, 0.0, (), (), ())
    t0 = min(s.start for s in spans)
    duration = max(s.end for s in spans) - t0
    workers = sorted({s.worker for s in spans if s.worker is not None}, key=natural_key)
    rows: list[Row] = []
    for w in workers:
        mine = [s for s in spans if s.worker == w]
        for name in sorted({s.name for s in mine if s.lane == UNIT}, key=natural_key):
            bars = [_bar(s, t0) for s in mine if s.lane == UNIT and s.name == name]
            rows.append(Row(f"unit:{w}:{name}", f"{w} · {name}", UNIT, w, _by_start(bars)))
        blocked = [_bar(s, t0) for s in mine if s.lane == BLOCKED]
        if blocked:
            # Per step (a step's save calls and its fence together): what a training step lost.
            per_step: dict[int, float] = defaultdict(float)
            for b in blocked:
                per_step[b.step] += b.end - b.start
            median, most = statistics.median(per_step.values()), max(per_step.values())
            rows.append(Row(f"blocked:{w}", f"{w} · blocked/step: median {_ms(median)}, max {_ms(most)}", BLOCKED, w,
                            _by_start(blocked)))
    for lane, title in ((COMMIT, "monitor · commit"), (MIRROR, "monitor · mirror upload")):
        bars = [_bar(s, t0) for s in spans if s.lane == lane]
        if bars:
            rows.append(Row(lane, title, lane, None, _by_start(bars)))
    return Layout(run, t0, duration, tuple(rows), _step_marks(spans, t0), _table(spans, t0, workers))


def _by_start(bars: list[Bar]) -> tuple[Bar, ...]:
    return tuple(sorted(bars, key=lambda b: (b.start, b.step)))


def _step_marks(spans: list[Span], t0: float) -> tuple[StepMark, ...]:
    by_step: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_step[s.step].append(s)
    marks = []
    for step in sorted(by_step):
        commits = [s.end - t0 for s in by_step[step] if s.lane == COMMIT and s.ok]
        marks.append(StepMark(step, min(s.start for s in by_step[step]) - t0, max(commits) if commits else None))
    return tuple(marks)


def _table(spans: list[Span], t0: float, workers: list[str]) -> tuple[StepNumbers, ...]:
    by_step: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        by_step[s.step].append(s)
    out = []
    for step in sorted(by_step):
        mine = by_step[step]
        units = [s for s in mine if s.lane == UNIT]
        commits = [s for s in mine if s.lane == COMMIT]
        uploads = [s for s in mine if s.lane == MIRROR]
        blocked = {w: sum(s.duration for s in mine if s.lane == BLOCKED and s.worker == w) * 1000 for w in workers
                   if any(s.lane == BLOCKED and s.worker == w for s in mine)}
        kinds = sorted({k for s in commits if s.ok for k in s.name.split("+")})
        errors = [s.error for s in mine if s.error]
        out.append(StepNumbers(
            step=step, kinds="+".join(kinds) or "-", blocked_ms=blocked, units=len(units),
            failed=sum(1 for s in units if not s.ok),
            saving_s=(max(s.end for s in units) - min(s.start for s in units)) if units else None,
            commit_ms=sum(s.duration for s in commits) * 1000 if commits else None,
            committed_at_s=max(s.end for s in commits if s.ok) - t0 if any(s.ok for s in commits) else None,
            mirror_s=sum(s.duration for s in uploads) if uploads else None,
            error=errors[0] if errors else None,
        ))
    return tuple(out)
