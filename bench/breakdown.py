"""Where ckptd's durable time goes: the per-phase timings ckptd measures itself (:mod:`ckptd.phases`),
read back from the monitor's timeline after the measured saves.

Per step: the phases of every unit of the step added up (units that run side by side, such as
a model and its optimizer, add their times, so shares can sum past 100 %), plus the commit's
``commit`` and ``trackers``; the step's durable time is from its first save call (or unit)
until its commit ended, as the timeline has them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from ckptd.phases import ALL, NOTIFICATION

#: From the unit's span rather than its phases: from its start until the monitor admitted it
#: (the "started" round trip, and a writer slot with a save strategy), before anything is written.
ADMISSION = "admission"
#: The breakdown's columns, in the order a save goes through them.
COLUMNS = (ADMISSION, *ALL)


@dataclass
class Breakdown:
    """The phases of the saves of one scenario and method: one dict and one durable time per step."""

    label: str
    steps: list[dict[str, float]] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)

    def median_ms(self, name: str) -> float:
        return statistics.median([s.get(name, 0.0) for s in self.steps]) * 1000 if self.steps else 0.0

    def share(self, name: str) -> float:
        """The phase's median as a fraction of the median durable time."""
        d = statistics.median(self.durable) if self.durable else 0.0
        return self.median_ms(name) / 1000 / d if d > 0 else 0.0

    def to_json(self) -> dict:
        return {"label": self.label, "steps": len(self.steps),
                "durable_ms": statistics.median(self.durable) * 1000 if self.durable else None,
                "median_ms": {p: self.median_ms(p) for p in COLUMNS}, "share": {p: self.share(p) for p in COLUMNS}}


def _complete(spans: list[dict], step: int) -> bool:
    units = [s for s in spans if s["lane"] == "unit" and s["step"] == step]
    commits = [s for s in spans if s["lane"] == "commit" and s["step"] == step and not s.get("detail")]
    return bool(units) and bool(commits) and all(NOTIFICATION in (s.get("phases") or {}) for s in units)


def collect(monitor: Any, steps: list[int], worker: str, into: Breakdown, timeout_s: float = 10.0) -> None:
    """Add the phases of ``steps`` (committed saves of ``worker``) to ``into``.

    Waits up to ``timeout_s`` for the notification amendments (they ride with the coordinator's
    next notification, or its wait_all). A step whose spans are incomplete by then is left out.
    """
    if not steps:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        spans = ray.get(monitor.timeline.remote())["spans"]
        if all(_complete(spans, s) for s in steps) or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # polling the monitor's state with a deadline, not a guess at timing
    for step in steps:
        if not _complete(spans, step):
            continue
        mine = [s for s in spans if s["step"] == step and (s.get("worker") == worker or s["lane"] == "commit")]
        totals = dict.fromkeys(COLUMNS, 0.0)
        for s in mine:
            if s["lane"] == "unit" and s.get("admitted") is not None:
                totals[ADMISSION] += max(0.0, s["admitted"] - s["start"])
            if s["lane"] in ("unit", "commit"):
                for name, sec in (s.get("phases") or {}).items():
                    if name in totals:
                        totals[name] += sec
        begin = min(s["start"] for s in mine if s["lane"] in ("unit", "blocked"))
        end = max(s["end"] for s in mine if s["lane"] == "commit")
        into.steps.append(totals)
        into.durable.append(max(0.0, end - begin))


def table(breakdowns: list[Breakdown]) -> str:
    """Median ms per phase and its share of the median durable time, one row per breakdown."""
    head = "| ckptd phases (median ms, share of durable) | durable | " + " | ".join(COLUMNS) + " |"
    lines = [head, "| --- " * (len(COLUMNS) + 2) + "|"]
    for b in breakdowns:
        if not b.steps:
            continue
        d = statistics.median(b.durable) * 1000
        cells = [f"{b.median_ms(p):.3g} ({b.share(p) * 100:.0f} %)" for p in COLUMNS]
        lines.append(f"| {b.label} ({len(b.steps)} saves) | {d:.4g} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)

