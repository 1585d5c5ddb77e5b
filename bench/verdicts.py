"""From interleaved samples to a verdict with its reason: what the targets table prints.

A :class:`Comparison` is one target measured as interleaved pairs: ckptd's samples (A) and the
baseline's (B), taken ABBA... in the same run. :func:`judge` turns it into the ratio of medians,
its bootstrap interval and a verdict (:mod:`bench.stats`), and says why when it cannot tell.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import Row
from .stats import RatioEstimate, Verdict, bootstrap_ratio, verdict

#: Below this many pairs an interval is too coarse to be called a result.
MIN_PAIRS = 9


@dataclass
class Comparison:
    """One target measured by interleaved pairs: ``ratio = median(a) / median(b)``.

    Attributes:
        target: The name in ``TARGETS``.
        a: ckptd's samples (the numerator).
        b: The baseline's samples, paired with ``a`` (same index, same moment).
        percent: The target is a slowdown in percent, ``(ratio - 1) * 100``.
        noise: What makes this comparison noisy, for an inconclusive verdict's reason.
        detail: Where the difference goes, from the scenario's other rows: added to the reason
            of a verdict that is not met.
        outside: Why this run is outside the target's condition (P3's "when the checkpoint
            interval is longer than the save time"), or "" when it is within it. A run outside
            it is inconclusive whatever its interval: it did not measure what the target bounds.
    """

    target: str
    a: Row
    b: Row
    percent: bool = False
    noise: str = ""
    detail: str = ""
    outside: str = ""


def _show(value: float, percent: bool) -> str:
    return f"{(value - 1) * 100:+.1f} %" if percent else f"{value:.3g}"


def judge(c: Comparison, limit: float, *, smoke: bool = False) -> dict:
    """The target's verdict as the JSON and the table show it.

    ``limit`` is the target's bound, an upper one (every ratio target is "at most"); for a
    ``percent`` target it is in percent. A smoke run is always inconclusive: its sizes and pair
    counts say nothing about performance.
    """
    est: RatioEstimate = bootstrap_ratio(c.a.samples, c.b.samples)
    bound = 1 + limit / 100 if c.percent else limit
    v = verdict(est, at_most=bound)
    reason = ""
    interval = f"interval {_show(est.low, c.percent)} to {_show(est.high, c.percent)}"
    if smoke:
        v, reason = Verdict.INCONCLUSIVE, "smoke run: tiny sizes and few pairs"
    elif c.outside:
        v, reason = Verdict.INCONCLUSIVE, f"outside the target's condition: {c.outside}"
    elif v is Verdict.INCONCLUSIVE:
        reason = f"{interval} straddles {limit:g}{' %' if c.percent else ''}"
        if c.noise:
            reason += f": {c.noise}"
        if est.pairs < MIN_PAIRS:
            reason += f" (only {est.pairs} pairs: use --pairs {MIN_PAIRS} or more)"
    if v is not Verdict.MET and not smoke and c.detail:
        reason = f"{reason}; {c.detail}" if reason else c.detail
    out = {
        "value": (est.ratio - 1) * 100 if c.percent else est.ratio,
        "low": (est.low - 1) * 100 if c.percent else est.low,
        "high": (est.high - 1) * 100 if c.percent else est.high,
        "ratio": est.ratio, "ratio_low": est.low, "ratio_high": est.high,
        "pairs": est.pairs, "target": limit, "verdict": v.value, "reason": reason,
        "a": {"method": c.a.method, "samples": c.a.samples},
        "b": {"method": c.b.method, "samples": c.b.samples},
    }
    return out
