"""Verdicts that hold on a noisy machine: interleaved A/B repetitions, the ratio of their medians,
and a bootstrap 95 % interval of that ratio.

Two medians taken minutes apart compare two states of the machine (the page cache, the disk's
writeback, another process) as much as two methods. Interleaving puts A and B side by side in
time, so slow drift hits both; alternating the order of each pair (AB, BA, AB, ...) cancels a
trend within a pair too. The interval comes from resampling whole pairs, which keeps that
pairing. A target counts as met only when the whole interval is within it, and as missed only
when the whole interval is outside it; otherwise the bench cannot tell, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Verdict(str, Enum):
    MET = "met"
    MISSED = "missed"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class RatioEstimate:
    """``median(a) / median(b)`` over ``pairs`` interleaved pairs, with a ``confidence`` interval."""

    ratio: float
    low: float
    high: float
    pairs: int
    confidence: float

    def __str__(self) -> str:
        return f"{self.ratio:.3g} [{self.low:.3g}, {self.high:.3g}] ({self.pairs} pairs)"


def interleave(run_a: Callable[[], float], run_b: Callable[[], float], pairs: int) -> tuple[list[float], list[float]]:
    """Run ``pairs`` A/B pairs, alternating which goes first; each call returns one sample."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    a, b = interleave_rounds([run_a, run_b], pairs)
    return a, b


def interleave_rounds(runs: Sequence[Callable[[], float]], rounds: int) -> list[list[float]]:
    """Run ``rounds`` rounds of every method, the order rotating by one each round (ABC, BCA,
    CAB, ...: each method goes first as often as the others); one list of samples per method,
    paired by round."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: list[list[float]] = [[] for _ in runs]
    n = len(runs)
    for i in range(rounds):
        for j in range(n):
            k = (i + j) % n
            out[k].append(runs[k]())
    return out


def _interval(estimates: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central ``confidence`` interval of bootstrap ``estimates`` (percentile method)."""
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(estimates, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap_ratio(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000,
                    seed: int = 0) -> RatioEstimate:
    """The ratio of medians ``median(a) / median(b)`` of paired samples, and its percentile
    bootstrap interval (pairs resampled with replacement; ``seed`` makes it reproducible).

    Raises:
        ValueError: unpaired or empty samples, a non-positive sample of ``b``, or a bad
            ``confidence``.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number (> 0) of A and B samples, got {len(a)} and {len(b)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if (xb <= 0).any():
        raise ValueError("B's samples must be > 0 (they divide)")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(xa), size=(resamples, len(xa)))
    low, high = _interval(np.median(xa[idx], axis=1) / np.median(xb[idx], axis=1), confidence)
    return RatioEstimate(float(np.median(xa) / np.median(xb)), float(low), float(high), len(xa), confidence)


@dataclass(frozen=True)
class Estimate:
    """A value from ``n`` samples of one long run (a quantile of its commits, its rate over its
    steps), with a ``confidence`` interval."""

    value: float
    low: float
    high: float
    n: int
    confidence: float


def bootstrap_quantile(samples: Sequence[float], q: float, *, confidence: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> Estimate:
    """The ``q`` quantile of ``samples`` and its percentile bootstrap interval (samples resampled
    with replacement).

    A high quantile of few samples is their slowest few: the p99 of 50 commits is decided by the
    slowest two, and its interval spans them, so one stray commit makes the verdict inconclusive
    rather than met or missed. More samples narrow it.

    Raises:
        ValueError: no samples, or ``q`` or ``confidence`` out of range.
    """
    if not samples:
        raise ValueError("need at least one sample")
    if not 0 <= q <= 1 or not 0 < confidence < 1:
        raise ValueError(f"need 0 <= q <= 1 and 0 < confidence < 1, got q={q}, confidence={confidence}")
    x = np.asarray(samples, dtype=float)
    rng = np.random.default_rng(seed)
    low, high = _interval(np.quantile(x[rng.integers(0, len(x), size=(resamples, len(x)))], q, axis=1), confidence)
    return Estimate(float(np.quantile(x, q)), float(low), float(high), len(x), confidence)


def bootstrap_rate(counts: Sequence[float], seconds: Sequence[float], *, confidence: float = 0.95,
                   resamples: int = 10_000, seed: int = 0) -> Estimate:
    """``sum(counts) / sum(seconds)`` over ``n`` blocks of one run (its steps: the events of each,
    and the time it took), and its percentile bootstrap interval (blocks resampled with
    replacement).

    The interval says how much the run's own steps vary; a machine slower for the whole run
    moves every step, and with them the value, outside it.

    Raises:
        ValueError: unpaired or empty samples, a non-positive duration, or a bad ``confidence``.
    """
    if len(counts) != len(seconds) or not counts:
        raise ValueError(f"need as many counts as durations (> 0), got {len(counts)} and {len(seconds)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    c, t = np.asarray(counts, dtype=float), np.asarray(seconds, dtype=float)
    if (t <= 0).any():
        raise ValueError("every duration must be > 0")
    idx = np.random.default_rng(seed).integers(0, len(c), size=(resamples, len(c)))
    low, high = _interval(c[idx].sum(axis=1) / t[idx].sum(axis=1), confidence)
    return Estimate(float(c.sum() / t.sum()), float(low), float(high), len(c), confidence)


def verdict(estimate: RatioEstimate | Estimate, *, at_most: float | None = None,
            at_least: float | None = None) -> Verdict:
    """MET when the whole interval satisfies the bound(s), MISSED when the whole interval
    violates one, INCONCLUSIVE when the interval straddles a bound."""
    if (at_most is None) == (at_least is None):
        raise ValueError("give exactly one of at_most and at_least")
    if at_most is not None:
        if estimate.high <= at_most:
            return Verdict.MET
        return Verdict.MISSED if estimate.low > at_most else Verdict.INCONCLUSIVE
    if estimate.low >= at_least:
        return Verdict.MET
    return Verdict.MISSED if estimate.high < at_least else Verdict.INCONCLUSIVE
